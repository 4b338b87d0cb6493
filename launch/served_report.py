"""The served benchmark's report: per-round values -> medians, paired ratios, targets, a table.

Rounds hold one dict of named values per engine ("tpserve" keys are prefixed with the server,
``tp1/b1.decode_tok_s``; "llama.cpp" keys name the same figure, ``b1.decode_tok_s``). A ``Row``
says which value is ours, what it is compared with, and the target on the ratio. Ratios are
always "higher is better for tpserve": ours/theirs for rates, theirs/ours for costs, except
the within-tpserve ratios (prefix reuse, mid-stream gap), reported as measured with an upper
target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from launch.served_stats import median, paired_ratio

Rounds = dict[str, list[dict[str, float]]]  # engine -> one dict per round


@dataclass(frozen=True)
class Row:
    label: str
    ours: tuple[str, ...]  # tpserve keys shown (joined with " / "); the first is compared
    unit: str
    theirs: tuple[str, str] | None = None  # (engine, key) compared with ours[0]
    ratio_key: str | None = None  # a tpserve key that already is the ratio (per round)
    lower_is_better: bool = False
    goal: tuple[str, float] | None = None  # (">=" or "<=", value) on the ratio
    note: str = ""  # what the ratio compares with, e.g. "llama-bench tg128"


@dataclass(frozen=True)
class Summary:
    row: Row
    ours: tuple[float, ...]
    theirs: float | None
    ratio: float | None
    met: bool | None


def values(rounds: Rounds, engine: str, key: str) -> list[float | None]:
    return [r.get(key) for r in rounds.get(engine, [])]


def summarise(row: Row, rounds: Rounds) -> Summary:
    ours = tuple(median([v for v in values(rounds, "tpserve", k) if v is not None])
                 for k in row.ours)
    theirs, ratio = None, None
    if row.theirs is not None:
        engine, key = row.theirs
        other = values(rounds, engine, key)
        present = [v for v in other if v is not None]
        theirs = median(present) if present else None
        mine = values(rounds, "tpserve", row.ours[0])
        if row.lower_is_better:
            ratio = paired_ratio(other, mine)
        else:
            ratio = paired_ratio(mine, other)
    elif row.ratio_key is not None:
        ratio = median([v for v in values(rounds, "tpserve", row.ratio_key) if v is not None])
    if ratio is not None and math.isnan(ratio):
        ratio = None
    met = None
    if row.goal is not None and ratio is not None:
        op, bound = row.goal
        met = ratio >= bound if op == ">=" else ratio <= bound
    return Summary(row, ours, theirs, ratio, met)


def _fmt(v: float | None) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def table(summaries: Sequence[Summary]) -> str:
    """Markdown: figure | tpserve | llama.cpp | ratio | target."""
    lines = ["| figure | tpserve | llama.cpp | ratio | target |", "|---|---|---|---|---|"]
    for s in summaries:
        r = s.row
        ours = " / ".join(_fmt(v) for v in s.ours)
        unit = f" {r.unit}" if r.unit else ""
        shown = s.theirs is not None and r.theirs is not None and r.theirs[0] != "tpserve"
        theirs = f"{_fmt(s.theirs)}{unit}" if shown else ""
        ratio = f"{s.ratio:.2f}x" if s.ratio is not None else ""
        if r.note and ratio:
            ratio += f" ({r.note})"
        target = ""
        if r.goal is not None:
            target = f"{r.goal[0]} {r.goal[1]:g}x"
            target += "" if s.met is None else (": met" if s.met else ": not met")
        lines.append(f"| {r.label} | {ours}{unit} | {theirs} | {ratio} | {target} |")
    return "\n".join(lines)


def step_cost_slope(depths: Sequence[int], rates: Sequence[float]) -> float:
    """Least-squares ms per decode step added per 1K tokens of context (batch 1: 1/rate)."""
    pts = [(d / 1024, 1e3 / r) for d, r in zip(depths, rates) if r and not math.isnan(r)]
    if len(pts) < 2:
        return math.nan
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else math.nan


def with_slope(values_: dict[str, float], depths: Sequence[int], prefix: str = "") -> None:
    """Adds ``{prefix}ctx.ms_per_1k`` from the ``{prefix}ctx{d}.decode_tok_s`` values present."""
    have = [d for d in depths if f"{prefix}ctx{d}.decode_tok_s" in values_]
    if len(have) >= 2:
        values_[f"{prefix}ctx.ms_per_1k"] = step_cost_slope(
            have, [values_[f"{prefix}ctx{d}.decode_tok_s"] for d in have])
