"""CPU projections: tpserve::matmul (gemm.c) against ATen's F.linear, same weights, same run.

``python -m launch.bench_gemm [--threads 2] [--rows 1 4 16 64] [--rounds 7]`` times one decode
step's projection set (q/k/v, o, gate/up, down of every layer; no lm_head) of two Llama shapes,
bf16, for each row count M: the native op on ``--threads`` pool threads and ``F.linear`` on as
many torch threads, alternating round by round (the machine is shared and noisy), then prints
the medians and their ratio (the figures behind the note in tpserve/layers/linear.py).
``TPSERVE_AMX=0`` times gemm.c's AVX512-BF16 tiles where it would take AMX tiles.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.layers import cpu_ops


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int

    def weights(self, dtype: torch.dtype) -> list[torch.Tensor]:
        h, i = self.hidden, self.intermediate
        per_layer = [(3 * h, h), (h, h), (2 * i, h), (h, i)]
        gen = torch.Generator().manual_seed(0)
        return [torch.randn(o, k, generator=gen).to(dtype) * 0.02
                for _ in range(self.layers) for o, k in per_layer]


SHAPES = (Shape("h512x8 i1536", 512, 1536, 8), Shape("h2048x2 i5632", 2048, 5632, 2))


def _step(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weights: list[torch.Tensor],
          xs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        fn(xs[w.shape[1]], w)
    return time.perf_counter() - start


def bench(shape: Shape, rows: int, rounds: int, reps: int) -> tuple[float, float]:
    """Median ms per projection set: (native, ATen)."""
    weights = shape.weights(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {w.shape[1] for w in weights}}
    native = torch.ops.tpserve.matmul
    for fn in (native, F.linear):  # warm-up: first-touch, oneDNN primitive caches
        _step(fn, weights, xs)
    times: dict[str, list[float]] = {"native": [], "aten": []}
    for _ in range(rounds):
        times["native"].append(min(_step(native, weights, xs) for _ in range(reps)))
        times["aten"].append(min(_step(F.linear, weights, xs) for _ in range(reps)))
    return statistics.median(times["native"]) * 1e3, statistics.median(times["aten"]) * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="launch.bench_gemm")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    loaded = cpu_ops.load()
    torch.set_num_threads(args.threads)
    threads = cpu_ops.set_matmul_threads(args.threads)
    print(f"ops: {loaded.impl}; pool threads {threads}, torch threads {torch.get_num_threads()}; "
          f"median of {args.rounds} alternating rounds (best of {args.reps} each)")
    print(f"{'shape':<16}{'M':>5}{'MB':>8}{'native ms':>11}{'ATen ms':>10}{'ATen/native':>13}")
    results = []
    for shape in SHAPES:
        mb = sum(w.numel() * 2 for w in shape.weights(torch.bfloat16)) / 1e6
        for rows in args.rows:
            ours, aten = bench(shape, rows, args.rounds, args.reps)
            results.append({"shape": shape.name, "rows": rows, "native_ms": ours, "aten_ms": aten,
                            "threads": threads})
            print(f"{shape.name:<16}{rows:>5}{mb:>8.1f}{ours:>11.2f}{aten:>10.2f}{aten / ours:>13.2f}")
    return results


if __name__ == "__main__":
    main()
