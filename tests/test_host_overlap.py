"""A plain step's output events go out from inside the next forward, just before the native
layer stack (``HostWork``): the HTTP thread then streams them while the engine thread holds
no GIL, instead of both queueing for it between steps. None is lost or sent twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.checkpoints import make_checkpoint
from tests.harness import build_engine, make_request, run_all
from tpserve.engine.plan import Layout
from tpserve.engine.runner import ModelRunner
from tpserve.engine.sampling_params import SamplingParams
from tpserve.layers import cpu_ops
from tpserve.layers.fused_decoder import DecoderStack

NEW = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")


def _track(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Whether a runner forward is in progress, and how many stack calls have started."""
    state: dict[str, Any] = {"forward": False, "stacks": 0}
    forward, run = ModelRunner.forward, DecoderStack.run

    def in_forward(self: ModelRunner, *args: Any, **kw: Any) -> Any:
        state["forward"] = True
        try:
            return forward(self, *args, **kw)
        finally:
            state["forward"] = False

    def counted(self: DecoderStack, *args: Any) -> Any:
        state["stacks"] += 1
        return run(self, *args)

    monkeypatch.setattr(ModelRunner, "forward", in_forward)
    monkeypatch.setattr(DecoderStack, "run", counted)
    return state


def test_events_go_out_inside_the_next_forward_before_its_stack(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if cpu_ops.load().impl != "c++":
        pytest.skip("the C++ ops are not built here (no native layer stack)")
    engine = build_engine(ckpt)
    assert engine.runner.model.stack is not None, engine.runner.model.stack_reason
    state = _track(monkeypatch)
    seen: list[tuple[int, bool, int, bool]] = []
    req = make_request("r0", [5, 7, 9], SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                       ignore_eos=True))
    req.emit = lambda out: seen.append((len(out.output_ids), state["forward"], state["stacks"],
                                        out.finished))
    run_all(engine, [req])
    # Token k's event leaves during step k + 1's forward, before that step's stack call
    # (step 1 is the prompt); the last one when the engine runs out of work.
    assert seen == [(k, True, k, False) for k in range(1, NEW)] + [(NEW, False, NEW, True)]


def test_every_event_arrives_once_across_requests_finishing_apart(ckpt: Path) -> None:
    engine = build_engine(ckpt)
    events: dict[str, list[int]] = {}
    reqs = []
    for i, new in enumerate([2, 5, 3]):
        req = make_request(f"r{i}", [5 + i, 7, 9], SamplingParams(
            max_new_tokens=new, temperature=0.0, ignore_eos=True))
        req.emit = lambda out: events.setdefault(out.rid, []).append(len(out.output_ids))
        reqs.append(req)
    run_all(engine, reqs)
    assert {rid: counts[-1] for rid, counts in events.items()} == {"r0": 2, "r1": 5, "r2": 3}
    assert all(counts == sorted(set(counts)) for counts in events.values()), events
    assert not engine._events  # nothing left behind once idle


def test_host_work_runs_once_even_when_the_forward_fails(ckpt: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build_engine(ckpt)
    runner = engine.runner
    calls: list[int] = []

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("forward failed")

    monkeypatch.setattr(runner, "model", broken)
    # One token on page 1 (aux states asked for, so the eager model call is the one taken).
    layout = Layout(np.array([3]), np.array([1]), np.array([0]), np.array([[1]]))
    with pytest.raises(RuntimeError, match="forward failed"):
        runner.forward(layout, [0], (1,), host_work=lambda: calls.append(1))
    assert calls == [1]
