"""Start-up warm-up: its shapes fit the KV cache, it runs, and it leaves no trace in the counters."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from comm_backends.base import CommStats
from tests.checkpoints import make_checkpoint
from tests.harness import build_engine, make_request
from tpserve.dist import CommSwitch
from tpserve.engine.sampling_params import SamplingParams
from tpserve.engine.warmup import run_to_completion, warm_up, warmup_prompts, warmup_shape


@pytest.mark.parametrize(("max_running", "chunk", "context", "kv_tokens"),
                         [(64, 512, 2048, 500_000), (64, 512, 256, 6000), (16, 64, 200, 256)])
def test_shape_fits_the_cache_and_the_context(max_running: int, chunk: int, context: int,
                                              kv_tokens: int) -> None:
    shape = warmup_shape(max_running, chunk, context, kv_tokens)
    prompts = warmup_prompts(shape, vocab_size=100)
    assert len(prompts) == shape.requests <= max_running
    assert max(map(len, prompts)) + shape.new_tokens < min(context, kv_tokens)
    assert sum(len(p) + shape.new_tokens for p in prompts) <= kv_tokens
    assert all(3 <= t < 100 for p in prompts for t in p)


def test_warm_up_runs_and_forgets_its_traffic(tmp_path: Path) -> None:
    engine = build_engine(make_checkpoint(tmp_path / "m"), pages=64,
                          page_size=4, max_running=16, chunk=64, context_length=200)
    # A 2-rank job counts allreduces during the warm-up; stand in for that with a counted backend.
    stats = CommStats(phase="decode")
    for _ in range(50):
        stats.record(1024, 1e-5)
    comm = CommSwitch({"fake": SimpleNamespace(stats=stats, check=lambda: None)},  # type: ignore[dict-item]
                      "fake")
    engine.runner.comm = engine.profiler.comm = comm
    engine.profiler.enabled = True
    forgotten = []  # the adaptive chooser's measurements go too (a stand-in records it)
    engine.adaptive = SimpleNamespace(forget=lambda: forgotten.append(True),
                                      phase=lambda inner, name: inner)
    ids = itertools.count()
    shape = warmup_shape(16, 64, 200, kv_tokens=63 * 4)
    seconds = warm_up(engine, lambda p, sp: make_request(f"w{next(ids)}", p, sp), shape, 96)  # the checkpoint's vocabulary
    assert seconds > 0 and next(ids) == shape.requests
    assert not engine.scheduler.has_work() and engine.scheduler.allocator.num_free == 63
    assert engine.stats.steps == 0 and stats.calls == 0
    assert engine.profiler.snapshot()["steps"] == 0 and forgotten == [True]
    stats.phase = "decode"
    for _ in range(3):  # traffic after start-up is counted from zero (the baseline is not stale)
        stats.record(1024, 1e-5)
    assert engine.profiler.allreduce_by_phase(1)["decode"]["calls"] == 3


def test_a_stalled_schedule_raises_instead_of_spinning(tmp_path: Path) -> None:
    engine = build_engine(make_checkpoint(tmp_path / "m"), pages=4,
                          page_size=4, max_running=4, chunk=64, context_length=200)
    engine.scheduler.next_batch = lambda **_: None  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="stalled"):
        run_to_completion(engine, [make_request("r", [5, 6, 7], SamplingParams(max_new_tokens=2))])


def test_turning_profiling_on_starts_a_fresh_window(tmp_path: Path) -> None:
    """Per-step allreduce figures divide the calls made since profiling went on by the steps
    timed since then: calls from before (start-up, earlier traffic) must not be counted."""
    engine = build_engine(make_checkpoint(tmp_path / "m"), pages=16, page_size=4,
                          max_running=4, chunk=64, context_length=200)
    stats = CommStats(phase="decode")
    comm = CommSwitch({"fake": SimpleNamespace(stats=stats, check=lambda: None)},  # type: ignore[dict-item]
                      "fake")
    engine.runner.comm = engine.profiler.comm = comm
    for _ in range(50):  # traffic while profiling is off
        stats.record(1024, 1e-5)
    engine.reconfigure({"profiling": True})
    for _ in range(3):
        stats.record(1024, 1e-5)
    assert engine.profiler.allreduce_by_phase(1)["decode"]["calls"] == 3
    engine.reconfigure({"profiling": True})  # already on: the window keeps counting
    stats.record(1024, 1e-5)
    assert engine.profiler.allreduce_by_phase(1)["decode"]["calls"] == 4
