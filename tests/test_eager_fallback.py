"""A forward that finds no captured/compiled bucket runs eagerly, and says so: counted per
forward in the executor's report and logged once."""

from __future__ import annotations

import logging

import pytest
import torch

from tpserve.engine.buckets import Buckets
from tpserve.engine.compiled import CompileConfig, CompiledExecutor, inert_batch
from tpserve.engine.static_forward import StaticForward, run_static


def _double(fb, extras):  # type: ignore[no-untyped-def]
    return (fb.input_ids.reshape(-1).float() * 2,)


def test_fallbacks_and_static_runs_are_counted(caplog: pytest.LogCaptureFixture) -> None:
    forward = StaticForward("decode", 1, _double)
    executor = CompiledExecutor([forward], CompileConfig(Buckets((1, 2), (64,)), backend="eager",
                                                         fullgraph=False))
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        for batch in (1, 2, 3, 4, 2):
            out = run_static(executor, forward, inert_batch(batch, 1, 8, cpu), {})
            assert out[0].shape == (batch,)
    assert executor.info["static_runs"] == {"decode": 3}
    assert executor.info["eager_fallbacks"] == {"decode": 2}
    warnings = [r for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "batch 3" in warnings[0].getMessage()
