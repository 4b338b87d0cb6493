"""Which rows the served benchmark reports for the selected figures, and issue 15's targets.

Figures: ``b1``, ``b16``, ``b64`` (that many concurrent streams), ``ctx`` (decode after a
prompt of each depth), ``prefill`` (one long prompt), ``prefix`` (a repeated prompt), ``gap``
(a long prompt arriving while a stream runs). The concurrency figures run on every server
(``tps``); the others on ``long_tps`` only, since they take minutes per round.
"""

from __future__ import annotations

from collections.abc import Sequence

from launch.served_client import FigureConfig
from launch.served_report import Row

FIGURES = ("b1", "b16", "b64", "ctx", "prefill", "prefix", "gap")
LLAMA = "llama.cpp"
# Issue 15's targets, on the ratio to llama.cpp (or the within-tpserve ratio).
GOALS = {"b1": (">=", 0.8), "b16": (">=", 1.0), "ctx8192": (">=", 1.0),
         "prefill": (">=", 0.8), "prefix": ("<=", 0.3), "gap": ("<=", 0.08), "tp2/tp1": (">=", 1.0)}


def parse_figures(spec: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {unknown}; choose from {','.join(FIGURES)}")
    return names


def _concurrency_rows(clients: int, tp: int, cfg: FigureConfig) -> list[Row]:
    p, name = f"tp{tp}/", f"b{clients}"
    streams = f"{clients} stream{'s' if clients > 1 else ''}"
    tool = (f"llama-bench tg{cfg.tokens}" if clients == 1
            else f"llama-batched-bench S_TG, {clients} seqs")
    return [
        Row(f"decode, {streams}, TP={tp}",
            (f"{p}{name}.decode_tok_s",), "tok/s", (LLAMA, f"{name}.decode_tok_s"),
            goal=GOALS.get(name), note=tool),
        Row(f"output tok/s incl. prefill, {streams}, TP={tp}",
            (f"{p}{name}.output_tok_s",), "tok/s"),
        Row(f"TTFT / ITL p50 / ITL p99, {streams}, TP={tp}",
            (f"{p}{name}.ttft_ms", f"{p}{name}.itl_p50_ms", f"{p}{name}.itl_p99_ms"), "ms"),
    ]


def _long_rows(figure: str, tp: int, cfg: FigureConfig) -> list[Row]:
    p = f"tp{tp}/"
    if figure == "ctx":
        rows = [Row(f"decode at {d} context, TP={tp}", (f"{p}ctx{d}.decode_tok_s",), "tok/s",
                    (LLAMA, f"ctx{d}.decode_tok_s"), goal=GOALS.get(f"ctx{d}"),
                    note=f"tg{cfg.tokens} @ d{d}") for d in cfg.depths]
        if len(cfg.depths) > 1:
            rows.append(Row(f"decode step cost per 1K context, TP={tp}", (f"{p}ctx.ms_per_1k",),
                            "ms", (LLAMA, "ctx.ms_per_1k"), lower_is_better=True))
        return rows
    if figure == "prefill":
        n = cfg.prefill
        return [Row(f"{n}-token prompt: prompt tok/s (TTFT s), TP={tp}",
                    (f"{p}prefill{n}.tok_s", f"{p}prefill{n}.ttft_s"), "",
                    (LLAMA, f"prefill{n}.tok_s"), goal=GOALS["prefill"], note=f"pp{n}")]
    if figure == "prefix":
        n = cfg.prefix
        return [Row(f"repeated {n}-token prompt: TTFT 1st / 2nd, TP={tp}",
                    (f"{p}prefix{n}.ttft_first_s", f"{p}prefix{n}.ttft_second_s"), "s",
                    ratio_key=f"{p}prefix{n}.ratio", goal=GOALS["prefix"], note="2nd/1st")]
    n = cfg.gap_prompt
    return [Row(f"longest stream gap while a {n}-token prompt arrives / its TTFT alone, TP={tp}",
                (f"{p}gap{n}.max_gap_s", f"{p}gap{n}.ttft_alone_s"), "s",
                ratio_key=f"{p}gap{n}.ratio", goal=GOALS["gap"], note="gap/TTFT")]


def rows(figures: Sequence[str], tps: Sequence[int], long_tps: Sequence[int],
         cfg: FigureConfig) -> list[Row]:
    out: list[Row] = []
    for fig in figures:
        if fig.startswith("b"):
            clients = int(fig[1:])
            for tp in tps:
                out += _concurrency_rows(clients, tp, cfg)
            if clients == 1 and 1 in tps and 2 in tps:
                out.append(Row("decode, 1 stream, TP=2 / TP=1",
                               ("tp2/b1.decode_tok_s", "tp1/b1.decode_tok_s"),
                               "tok/s", ("tpserve", "tp1/b1.decode_tok_s"),
                               goal=GOALS["tp2/tp1"], note="TP=1"))
        else:
            for tp in long_tps:
                out += _long_rows(fig, tp, cfg)
    return out
