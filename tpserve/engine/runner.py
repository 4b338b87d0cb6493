"""Executes forward steps on one rank: build the batch, run the model, return logits.

Decode steps (one query per request, no aux states) go through ``static`` when one is set
(CUDA graphs or torch.compile, see ``engine/static_forward.py``); other steps, and decode
batches larger than every bucket, run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpserve.dist import CommSwitch
from tpserve.engine.forward_batch import HostWork
from tpserve.engine.kv_cache import KVCache
from tpserve.engine.plan import BatchLayout, build_forward_batch
from tpserve.engine.static_forward import StaticExecutor, StaticForward, decode_forward, run_static
from tpserve.engine.step_threads import StepThreads


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(logit_rows), V] float32, identical on every rank
    hidden: torch.Tensor  # [N, H] final-normed hidden states, one row per fed token
    aux: list[torch.Tensor]


class ModelRunner:
    def __init__(self, model: Any, kv: KVCache, device: torch.device,
                 comm: CommSwitch | None = None) -> None:
        self.model = model
        self.comm = comm
        self.kv = kv
        self.device = device
        self.page_size = kv.cfg.page_size
        self.decode_forward: StaticForward = decode_forward(model, kv.layers)
        self.static: StaticExecutor | None = None  # set by static_setup.install_static
        self.graph_info: dict[str, Any] = {}  # capture/compile report for server info
        self.threads = StepThreads.for_device(device)

    @torch.inference_mode()
    def forward(self, step: BatchLayout, logit_rows: Any, aux_layers: tuple[int, ...] = (),
                host_work: Callable[[], None] | None = None) -> ForwardOutput:
        """Run ``step``; logits only for ``logit_rows`` (rows of the ragged batch).
        ``host_work`` runs once during the forward (``HostWork``)."""
        self.threads.fit(len(step.token_ids))
        batch = build_forward_batch(step, self.page_size, self.device)
        batch.host_work = work = HostWork(host_work)
        if self.static is not None:
            work.run()  # a compiled run or a graph replay has no Python inside to run it
        try:
            if batch.queries == 1 and not aux_layers:
                logits, hidden = run_static(self.static, self.decode_forward, batch, {})
                if self.static is None and every_row(logit_rows, logits.shape[0]):
                    # A fresh tensor already in order (a captured graph's is its reused
                    # output buffer, and padded): the copy was ~0.3 ms a step at batch 16.
                    return ForwardOutput(logits=logits, hidden=hidden, aux=[])
                return ForwardOutput(logits=logits.index_select(0, self._rows(logit_rows)),
                                     hidden=hidden, aux=[])
            hidden, aux = self.model(batch, self.kv.layers, aux_layers)
            logits = self.model.logits(hidden.index_select(0, self._rows(logit_rows)))
            return ForwardOutput(logits=logits, hidden=hidden, aux=aux)
        finally:
            work.run()  # a model that never started it

    def _rows(self, logit_rows: Any) -> torch.Tensor:
        return torch.as_tensor(logit_rows, dtype=torch.long).to(self.device)


def every_row(logit_rows: Any, rows: int) -> bool:
    """Whether ``logit_rows`` is 0, 1, ..., rows - 1: every row, in order. On Python lists:
    four numpy calls cost ~45 us a decode step here, run on caches the weight stream had just
    emptied (a list of a batch's rows is short)."""
    picked = logit_rows.tolist() if isinstance(logit_rows, np.ndarray) else list(logit_rows)
    return picked == list(range(rows))
