"""The llama.cpp side of one benchmark round: each figure from llama-bench / batched-bench.

Keys match tpserve's figure names (``b1.decode_tok_s``, ``ctx8192.decode_tok_s``,
``prefill8192.tok_s``, ``b16.decode_tok_s``). llama.cpp runs at each thread count asked for,
and each figure counts its best: its threads meet at a barrier per graph node, so on a shared
machine a descheduled thread stalls the others (measured here at load average 13 on 2 CPUs:
tg32 at 4 tok/s with -t 2, 68 with -t 1), while on a quiet one all cores win. Comparing with
llama.cpp's best thread count keeps the ratio honest in both conditions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from launch.llamacpp_tools import LlamaCpp
from launch.served_client import FigureConfig


def llama_figures(llama: LlamaCpp, figures: Sequence[str], cfg: FigureConfig) -> dict[str, float]:
    values: dict[str, float] = {}
    depths = ([0] if "b1" in figures else []) + (list(cfg.depths) if "ctx" in figures else [])
    if depths:
        for t in llama.bench("-p", "0", "-n", str(cfg.tokens), "-d", ",".join(map(str, depths))):
            key = "b1" if t.n_depth == 0 else f"ctx{t.n_depth}"
            values[f"{key}.decode_tok_s"] = t.avg_ts
    if "prefill" in figures:
        for t in llama.bench("-p", str(cfg.prefill), "-n", "0"):
            values[f"prefill{cfg.prefill}.tok_s"] = t.avg_ts
    parallel = [int(f[1:]) for f in figures if f.startswith("b") and f != "b1"]
    if parallel:
        for r in llama.batched(cfg.prompt, cfg.tokens, parallel):
            values[f"b{r.b}.decode_tok_s"] = r.s_tg
    return values


def best_of_threads(per_threads: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each figure's best rate over thread counts, plus every count's own (``key@tN``) and the
    winning count (``key.threads``)."""
    out: dict[str, float] = {}
    for threads, values in per_threads.items():
        for key, value in values.items():
            out[f"{key}@t{threads}"] = value
            if value > out.get(key, float("-inf")):
                out[key], out[f"{key}.threads"] = value, float(threads)
    return out


def llama_round(llama: LlamaCpp, threads: Sequence[int], figures: Sequence[str],
                cfg: FigureConfig) -> dict[str, float]:
    return best_of_threads({t: llama_figures(replace(llama, threads=t), figures, cfg)
                            for t in threads})
