"""CUDA graphs on CPU for the executor's tests: a stand-in graph whose replay re-runs the
captured forward on the graph's static inputs. A backend that plans on the host must then do
no host work of its own at replay, so everything a replayed step knows about its pages has
to come from ``graph_replan`` (through the static inputs or a wrapper's fixed buffers), which
is what a real replay reads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tpserve.engine import graphs
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.static_forward import StaticForward


class ReplayByRerun:
    def __init__(self, forward: StaticForward, fb: ForwardBatch,
                 extras: dict[str, torch.Tensor], outputs: tuple[torch.Tensor, ...]) -> None:
        self.forward, self.fb, self.extras, self.outputs = forward, fb, extras, outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.forward.fn(self.fb, self.extras), strict=True):
            out.copy_(new)


def record(forward: StaticForward, fb: ForwardBatch, extras: dict[str, torch.Tensor],
           pool: Any, device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
    forward.fn(fb, extras)  # warm-up
    outputs = forward.fn(fb, extras)
    return ReplayByRerun(forward, fb, extras, outputs), outputs


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture with ``record`` and no CUDA calls."""
    monkeypatch.setattr(graphs, "_record", record)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (0, 0))
