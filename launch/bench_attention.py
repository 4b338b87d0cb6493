"""Decode attention per layer call: the native ``cpu`` backend vs today's gather + SDPA path.

``python -m launch.bench_attention [--batches 1 16] [--contexts 128 ... 16384] [--rounds 5]
[--threads 1]`` builds, per (batch, context), one decode step of the issue-15 model's attention
(8 query heads, 4 KV heads, head_dim 64, bf16 cache, 16-token pages scattered at random) and
times, alternating within each round (medians over rounds):

- ``native``: ``CpuAttention.forward`` (K/V write + paged attention, one op);
- ``gather``: ``paged_attention`` from ``layers/attention/gather.py`` (what the models call
  today) on the ForwardBatch ``build_forward_batch`` makes;
- per step, the host set-up each needs once: ``build_forward_batch`` vs ``build_metadata`` +
  ``prepare``;
- read bandwidth: a 256 MB fp32 sum on the same threads.

Calls cycle through copies of the cache (64 MB in all, at most 64 copies), so the KV comes from
memory as in a model step, not from a warm L3 (the small contexts stay partly cached). On one
thread the clock is the thread's CPU time: on a shared machine wall time mostly measured other
processes' time slices (a call's wall time jumped in ~4 ms steps).

It prints ms per layer call, the ratio, and the extra ms per 1K tokens of context (least
squares over contexts >= 1K) next to the time to read that KV once at the measured bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpserve.engine.plan import StepPlan, build_forward_batch
from tpserve.layers.attention import AttentionSpec, build_metadata, create, paged_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE, DTYPE = 8, 4, 64, 16, torch.bfloat16
CPU = torch.device("cpu")


@dataclass
class Problem:
    batch: int
    context: int
    q: torch.Tensor  # [B, 1, Hq, D]
    k: torch.Tensor  # [B, 1, Hk, D]
    v: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # copies, used in turn
    plan: StepPlan

    def cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next copy: with enough copies the KV read by a call is cold, as in a model step
        (every layer has its own cache and the weights stream in between), while the code and
        the small tensors stay warm, as they do when every layer runs them."""
        self.caches.append(self.caches.pop(0))
        return self.caches[0]

    @property
    def kv_bytes(self) -> int:  # K and V of every key the step reads
        return 2 * self.batch * self.context * KV_HEADS * HEAD_DIM * DTYPE.itemsize


def problem(batch: int, context: int, cold_bytes: int, seed: int = 0) -> Problem:
    """One decode step: each request has ``context - 1`` cached keys and one new token; enough
    cache copies to cycle through ``cold_bytes`` (at most 64)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    per = -(-context // PAGE)
    pages = rng.permutation(np.arange(1, batch * per + 1)).astype(np.int32).reshape(batch, per)
    slots = (batch * per + 1) * PAGE
    one = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    copies = min(64, -(-cold_bytes // (2 * one.numel() * one.element_size())))
    caches = [(one.clone(), one.clone()) for _ in range(copies)]
    plan = StepPlan(kind="forward", token_ids=np.zeros((batch, 1), dtype=np.int64),
                    q_lens=np.ones(batch, dtype=np.int32),
                    cached_lens=np.full(batch, context - 1, dtype=np.int32), page_table=pages)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(batch, 1, heads, HEAD_DIM, generator=gen).to(DTYPE)

    return Problem(batch, context, rand(HEADS), rand(KV_HEADS), rand(KV_HEADS), caches, plan)


def median_ms(fn: Callable[[], Any], calls: int, clock: Callable[[], float]) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def read_gbs(buffer: torch.Tensor, clock: Callable[[], float]) -> float:
    return buffer.numel() * buffer.element_size() / median_ms(buffer.sum, 3, clock) * 1e3 / 1e9


def measure(p: Problem, rounds: int, calls: int, bandwidth: torch.Tensor,
            clock: Callable[[], float]) -> dict[str, float]:
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, DTYPE)
    native = create("cpu", spec, CPU)
    plan = p.plan
    kv_lens = plan.cached_lens + plan.q_lens
    meta = build_metadata(plan.page_table, plan.q_lens, kv_lens, PAGE, CPU)
    step = native.prepare(meta)
    fb = build_forward_batch(plan, PAGE, None, CPU)
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (p.q, p.k, p.v))
    runs: dict[str, Callable[[], Any]] = {
        "native": lambda: native.forward(q, k, v, p.cache(), step),
        "gather": lambda: paged_attention(p.q, p.k, p.v, p.cache(), fb, spec.scale),
        "native_setup": lambda: native.prepare(
            build_metadata(plan.page_table, plan.q_lens, kv_lens, PAGE, CPU)),
        "gather_setup": lambda: build_forward_batch(plan, PAGE, None, CPU),
    }
    got: dict[str, list[float]] = {name: [] for name in runs}
    got["read_gbs"] = []
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            got[name].append(median_ms(runs[name], calls, clock))
        got["read_gbs"].append(read_gbs(bandwidth, clock))
    return {name: statistics.median(values) for name, values in got.items()}


def slope_per_1k(contexts: list[int], ms: list[float]) -> float:
    pts = [(c, m) for c, m in zip(contexts, ms) if c >= 1024]
    if len(pts) < 2:
        return float("nan")
    x, y = np.array([c for c, _ in pts], float), np.array([m for _, m in pts])
    return float(np.polyfit(x, y, 1)[0] * 1024)


def report(rows: list[dict[str, Any]], batches: list[int]) -> None:
    print(f"{'batch':>5} {'context':>7} {'native ms':>10} {'gather ms':>10} {'ratio':>6} "
          f"{'setup ms new/old':>17} {'read GB/s':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>7} {r['native']:>10.3f} {r['gather']:>10.3f} "
              f"{r['gather'] / r['native']:>5.1f}x {r['native_setup']:>8.3f}/{r['gather_setup']:<8.3f}"
              f" {r['read_gbs']:>9.1f}")
    for b in batches:
        mine = [r for r in rows if r["batch"] == b]
        ctx = [r["context"] for r in mine]
        gbs = statistics.median(r["read_gbs"] for r in mine)
        ideal = 2 * b * 1024 * KV_HEADS * HEAD_DIM * DTYPE.itemsize / (gbs * 1e9) * 1e3
        print(f"batch {b}: extra ms per 1K context: native "
              f"{slope_per_1k(ctx, [r['native'] for r in mine]):.4f}, gather "
              f"{slope_per_1k(ctx, [r['gather'] for r in mine]):.4f}, reading that KV once at "
              f"{gbs:.1f} GB/s {ideal:.4f}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="launch.bench_attention", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--contexts", type=int, nargs="+",
                    default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5, help="timed calls per round (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (TP=1 default: 1)")
    ap.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                    help="cpu: the calling thread's CPU time (a shared machine's preemption does "
                         "not count; only meaningful on one thread); auto: cpu on one thread")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu_clock = args.clock == "cpu" or (args.clock == "auto" and args.threads == 1)
    clock = time.thread_time if cpu_clock else time.perf_counter
    print(f"threads {args.threads}, clock {'thread CPU time' if cpu_clock else 'wall'}")
    bandwidth = torch.ones(64 << 20, dtype=torch.float32)  # 256 MB: far past the caches
    rows = []
    for b in args.batches:
        for c in args.contexts:
            with torch.inference_mode():
                got = measure(problem(b, c, 64 << 20), args.rounds, args.calls, bandwidth, clock)
            rows.append({"batch": b, "context": c, **got})
    report(rows, args.batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
