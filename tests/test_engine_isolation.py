"""An error that belongs to one request fails that request only; the engine serves the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tpserve.engine.engine as engine_module
from tests.checkpoints import make_checkpoint
from tests.harness import build_engine, make_request, run_all
from tpserve.engine.request import RequestOutput
from tpserve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 7, 9, 11], [20, 21, 22], [40, 41, 42, 43, 44]]
POISON_TOP_K = 7  # the sampling parameter that our broken sampler chokes on


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")


def _requests(top_ks: list[int]) -> tuple[list[Any], dict[str, RequestOutput]]:
    finals: dict[str, RequestOutput] = {}
    reqs = []
    for i, (prompt, top_k) in enumerate(zip(PROMPTS, top_ks, strict=True)):
        # A top log-probability asked: greedy steps then sample from the logits (without,
        # the head picks them natively and the sampler never runs).
        params = SamplingParams(max_new_tokens=6, temperature=0.0, top_k=top_k, ignore_eos=True,
                                logprobs=1)
        req = make_request(f"r{i}", prompt, params)
        req.emit = lambda out, f=finals: f.__setitem__(out.rid, out) if out.finished else None
        reqs.append(req)
    return reqs, finals


def test_a_request_whose_sampling_raises_fails_alone(ckpt: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    clean = run_all(build_engine(ckpt), _requests([0, 0, 0])[0])
    real_sample = engine_module.sample

    def broken(logits: Any, params: list[SamplingParams], gens: Any) -> Any:
        if any(p.top_k == POISON_TOP_K for p in params):
            raise OverflowError("top_k out of range")
        return real_sample(logits, params, gens)

    monkeypatch.setattr(engine_module, "sample", broken)
    engine = build_engine(ckpt)
    reqs, finals = _requests([0, POISON_TOP_K, 0])
    outputs = run_all(engine, reqs)
    assert outputs[0] == clean[0] and outputs[2] == clean[2]
    reason = finals["r1"].finish_reason
    assert reason["type"] == "abort" and "top_k out of range" in reason["message"]
    assert not engine.scheduler.has_work()
    engine.scheduler.flush_cache()  # cached prefixes are reusable, not leaked
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable


def test_a_request_whose_detokenizer_raises_fails_alone(ckpt: Path) -> None:
    clean = run_all(build_engine(ckpt), _requests([0, 0, 0])[0])
    engine = build_engine(ckpt)
    reqs, finals = _requests([0, 0, 0])

    class Broken:
        def add(self, ids: list[int]) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    reqs[0].detok = Broken()
    outputs = run_all(engine, reqs)
    assert outputs[1:] == clean[1:]
    assert finals["r0"].finish_reason["type"] == "abort"
    assert "detokenizing" in finals["r0"].finish_reason["message"]
    engine.scheduler.flush_cache()  # cached prefixes are reusable, not leaked
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable
