"""Scheduling must never change outputs: chunked prefill, preemption, abort, page return."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.harness import build_engine, make_request, run_all
from tpserve.engine.sampling_params import SamplingParams

PROMPTS = [[5, 7, 9, 11, 13, 3, 4], [20, 21, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")


def requests(n: int = 16, temperature: float = 0.0) -> list:
    params = SamplingParams(max_new_tokens=n, temperature=temperature, ignore_eos=True, seed=3)
    return [make_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]


def test_chunked_prefill_and_batching_do_not_change_output(ckpt: Path) -> None:
    ref = [run_all(build_engine(ckpt), [r])[0] for r in requests()]
    chunked = run_all(build_engine(ckpt, chunk=3), requests())
    assert chunked == ref


def test_preemption_recomputes_identically(ckpt: Path) -> None:
    ref = run_all(build_engine(ckpt), requests(24, temperature=1.0))
    # 9 usable pages x 4 tokens: three requests of up to 35 tokens cannot all stay resident.
    engine = build_engine(ckpt, pages=10)
    out = run_all(engine, requests(24, temperature=1.0))
    assert engine.scheduler.preemptions > 0
    assert out == ref
    engine.scheduler.flush_cache()  # cached prefixes are reusable, not leaked
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable


def test_abort_frees_pages(ckpt: Path) -> None:
    engine = build_engine(ckpt)
    reqs = requests(50)
    for r in reqs:
        engine.scheduler.add(r)
    for _ in range(4):
        engine.step(engine.scheduler.next_batch())
    assert engine.scheduler.allocator.num_free < engine.scheduler.allocator.num_usable
    assert engine.scheduler.abort("r1") and not engine.scheduler.abort("nope")
    assert reqs[1].finish_reason["type"] == "abort"
    while engine.scheduler.has_work():
        engine.step(engine.scheduler.next_batch())
    engine.scheduler.flush_cache()  # cached prefixes are reusable, not leaked
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable
    assert len(reqs[0].output_ids) == 50 and len(reqs[1].output_ids) < 50


def test_request_larger_than_cache_is_refused(ckpt: Path) -> None:
    engine = build_engine(ckpt, pages=3)
    big = make_request("big", list(range(3, 40)), SamplingParams(max_new_tokens=4, temperature=0))
    small = make_request("small", [3, 4], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    run_all(engine, [big, small])
    assert big.finish_reason["type"] == "abort" and "KV cache" in big.finish_reason["message"]
    assert len(small.output_ids) == 4


def test_stop_conditions(ckpt: Path) -> None:
    free = run_all(build_engine(ckpt), requests(12))[0]
    eos_at = free[5]
    engine = build_engine(ckpt)
    req = make_request("e", PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0),
                       eos=frozenset({eos_at}))
    run_all(engine, [req])
    first = free.index(eos_at)
    assert req.output_ids == free[: first + 1]
    assert req.finish_reason == {"type": "stop", "matched": eos_at}
    req2 = make_request("s", PROMPTS[0], SamplingParams(max_new_tokens=12, temperature=0,
                                                        stop_token_ids=(eos_at,), min_new_tokens=first + 1))
    run_all(build_engine(ckpt), [req2])
    assert len(req2.output_ids) > first + 1


def _mixed_run(ckpt: Path, **kw: object) -> tuple[bool, list[tuple[str, list[int]]]]:
    """(outputs equal the unmixed engine's, every step's (kind, q_lens)) for a long prompt
    admitted while short ones decode."""
    long_prompt = [(7 * i) % 90 + 3 for i in range(40)]
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    def reqs() -> list:
        return [make_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS + [long_prompt])]

    ref = run_all(build_engine(ckpt, disable_mixed_chunk=True, **kw), reqs())
    engine = build_engine(ckpt, **kw)
    sched, batches = engine.scheduler, []
    original = sched.next_batch

    def record(**kw):  # type: ignore[no-untyped-def]
        batch = original(**kw)
        if batch is not None:
            batches.append((batch.kind, list(batch.q_lens)))
        return batch

    sched.next_batch = record  # type: ignore[method-assign]
    return run_all(engine, reqs()) == ref, batches


def test_mixed_steps_carry_decode_tokens_and_prompt_chunks(ckpt: Path) -> None:
    """A long prompt admitted while others decode rides along in pieces; outputs unchanged."""
    same, batches = _mixed_run(ckpt, chunk=8)
    mixed = [lens for kind, lens in batches if kind == "mixed"]
    assert same and mixed and all(sum(lens) <= 8 for _, lens in batches)
    assert any(1 in lens and max(lens) > 1 for lens in mixed)


def test_mixed_chunk_size_bounds_prompt_tokens_beside_decode(ckpt: Path) -> None:
    """--mixed-chunk-size caps the prompt part of a step that also decodes (a stream's stall);
    a step with nothing decoding still takes the whole --chunked-prefill-size."""
    same, batches = _mixed_run(ckpt, chunk=16, mixed_chunk_size=3)
    mixed = [lens for kind, lens in batches if kind == "mixed"]
    assert same and mixed
    assert all(sum(n for n in lens if n > 1) <= 3 for lens in mixed)
    assert max(sum(lens) for kind, lens in batches if kind == "prefill") > 3
