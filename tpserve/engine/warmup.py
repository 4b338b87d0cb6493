"""Warm-up before serving: run the biggest batches the scheduler will form, then report ready.

Why: a soak of the 2-rank demo server (32 streaming clients) grew each rank's RSS by ~80 MB in
its first 15 s and ~20 MB more in the next 45 s, then only +3 MB over the last 2 minutes: the
allocator's pools grow to the largest prefill chunk and decode batch the load produces, and
stay. Running those shapes at start (all ranks follow the plans) means the memory a server
has when ``/health`` turns 200 is the memory it serves with, and the first real requests do
not pay for the growth. It also runs the speculative paths when a draft is loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpserve.engine.request import Request
from tpserve.engine.sampling_params import SamplingParams

RequestFactory = Callable[[list[int], SamplingParams], Request]


@dataclass(frozen=True)
class WarmupShape:
    requests: int  # decoded together: the largest decode batch
    prompt_len: int  # short prompts: together they fill one prefill chunk
    long_prompt_len: int  # one long prompt: prefill attention over a long context
    new_tokens: int


def warmup_shape(max_running: int, chunk: int, context_length: int, kv_tokens: int,
                 new_tokens: int = 4) -> WarmupShape:
    """Sized from the scheduler's limits, and small enough to fit the KV cache all at once."""
    room = max(1, min(context_length, kv_tokens // 2) - new_tokens - 1)
    max_running = max(1, min(max_running, kv_tokens // (4 * (new_tokens + 2))))
    short = max(1, min(room, -(-chunk // max(1, max_running - 1)),
                       kv_tokens // (2 * max_running) - new_tokens))
    return WarmupShape(requests=max_running, prompt_len=short,
                       long_prompt_len=max(1, min(room, 2 * chunk)), new_tokens=new_tokens)


def warmup_prompts(shape: WarmupShape, vocab_size: int) -> list[list[int]]:
    """Token ids spread over the vocabulary (skipping the first few: often special tokens)."""
    first = min(3, vocab_size - 1)
    span = max(1, vocab_size - first)

    def prompt(length: int, offset: int) -> list[int]:
        return [first + (offset + 7 * i) % span for i in range(length)]

    lengths = [shape.long_prompt_len] + [shape.prompt_len] * (shape.requests - 1)
    return [prompt(n, i) for i, n in enumerate(lengths)]


def run_to_completion(engine: Any, requests: list[Request]) -> None:
    """Drive ``engine`` synchronously (no engine thread) until ``requests`` finish.

    Nothing else can free pages here, so a step the scheduler cannot form would never form:
    raise rather than spin.
    """
    for req in requests:
        engine.scheduler.add(req)
    while engine.scheduler.has_work():
        batch = engine.next_batch()
        if batch is None:
            raise RuntimeError("scheduler stalled with work left (KV cache too small?)")
        engine.step(batch)


def warm_up(engine: Any, make_request: RequestFactory, shape: WarmupShape, vocab_size: int) -> float:
    """Run the warm-up batches; returns the seconds it took. Statistics are reset after."""
    start = time.perf_counter()
    params = SamplingParams(max_new_tokens=shape.new_tokens, temperature=0.0, ignore_eos=True)
    run_to_completion(engine, [make_request(p, params) for p in warmup_prompts(shape, vocab_size)])
    _forget(engine)
    return time.perf_counter() - start


def _forget(engine: Any) -> None:
    """Counters start at zero when serving starts: the warm-up is not traffic.

    The allreduce counters go first: the profiler's reset snapshots them as its baseline.
    """
    if engine.runner.comm is not None:
        engine.runner.comm.reset_stats()
    engine.reset_stats()
    if engine.adaptive is not None:
        engine.adaptive.forget()  # its first steps of each setting paid one-time costs
    engine.scheduler.flush_cache()  # synthetic prompts: no use keeping their pages
