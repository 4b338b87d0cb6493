"""The step profiler's own cost: decode tok/s with it off and on, alternating, best of N.

``python -m launch.bench_profiler [--rounds 4 --tokens 300]`` runs the built-in demo target
at TP=1 through the real engine loop (profiler step + phases) and prints both rates.
"""

from __future__ import annotations

import argparse
import time

from tpserve.args import ServerArgs
from tpserve.engine.profiler import StepProfiler
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine


def decode_rate(offline: OfflineEngine, profiling: bool, tokens: int) -> float:
    engine = offline.engine
    engine.profiler.enabled = profiling
    req = offline.request([5, 6, 7], SamplingParams(max_new_tokens=tokens, temperature=0,
                                                    ignore_eos=True), {})
    engine.scheduler.add(req)
    engine.step(engine.scheduler.next_batch())  # prefill, not timed
    start, steps = time.perf_counter(), 0
    while engine.scheduler.has_work():
        began = time.perf_counter()
        batch = engine.scheduler.next_batch()
        with engine.profiler.step(began):  # the same wrapping Engine.run does
            engine.profiler.record("schedule", time.perf_counter() - began)
            engine.step(batch)
        steps += 1
    return steps / (time.perf_counter() - start)


def phase_entry_us(enabled: bool, n: int = 200_000) -> float:
    """Cost of one ``with profiler.phase(...)`` — deterministic, unlike end-to-end tok/s here."""
    prof = StepProfiler(enabled=enabled)
    start = time.perf_counter()
    for _ in range(n):
        with prof.phase("x"):
            pass
    return (time.perf_counter() - start) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="launch.bench_profiler")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args(argv)
    engine = OfflineEngine(ServerArgs(dtype="bfloat16", context_length=1024, page_size=16,
                                      max_total_tokens=399 * 16, cpu_threads=1, device="cpu"))
    decode_rate(engine, False, 32)  # warm-up
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for on in (False, True):
            rates[on].append(decode_rate(engine, on, args.tokens))
    off, on = max(rates[False]), max(rates[True])
    entries = 8  # phase entries per plain decode step (schedule, control, decode, sample, ...)
    cost = entries * (phase_entry_us(True) - phase_entry_us(False))
    print(f"profiler bookkeeping: {cost:.1f} us per step = {cost * off / 1e4:.2f}% of a "
          f"{1e3 / off:.2f} ms step")
    print(f"profiler off {off:.1f} tok/s, on {on:.1f} tok/s: overhead {100 * (off / on - 1):.1f}% "
          f"(best of {args.rounds}; off runs {[round(x) for x in rates[False]]}, "
          f"on runs {[round(x) for x in rates[True]]})")


if __name__ == "__main__":
    main()
