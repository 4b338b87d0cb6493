"""Writing the served benchmark's results: JSON, the markdown table, a PNG of the ratios."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launch.machine import describe
from launch.served_report import Summary, table


def plain(x: Any) -> Any:
    """JSON-safe: dataclasses to dicts, NaN to null (strict JSON has no NaN)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return plain(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def markdown(res: dict[str, Any]) -> str:
    agree = res["agreement"]
    lines = [table(res["summaries"]), "",
             "Values: medians over rounds. Ratio: the median of per-round ratios (each round "
             "pairs the engines under the same load), higher is better for tpserve except the "
             "2nd/1st and gap/TTFT rows, whose targets are upper bounds.",
             f"Machine: {describe(res['machine'])}.",
             f"Command: `{' '.join(res['command'])}`.",
             f"Model: {res['model']['mb_per_token']:.1f} MB of bf16 weights read per token."]
    if res["llama.cpp"]:
        threads = ", ".join(map(str, res["llama.cpp"]["threads"]))
        lines.append(f"llama.cpp: {res['llama.cpp']['bin']}; threads {threads}, each figure "
                     f"its best (winning -t per round: {thread_wins(res['rounds']['llama.cpp'])}).")
    lines.append(f"Agreement: {agree if isinstance(agree, str) else agree['summary']}.")
    loads = [x for part in res["load"] for x in part["loadavg_1m"]]
    if loads:
        lines.append(f"1-minute load average during the rounds: {min(loads):.1f} to "
                     f"{max(loads):.1f} on {res['machine']['cpus']} CPUs.")
    lines += [f"Note: {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def thread_wins(rounds: Sequence[dict[str, float]]) -> str:
    """'b1 1,1,2; b16 2,2,2': llama.cpp's winning thread count per figure and round."""
    keys = sorted({k for r in rounds for k in r if k.endswith(".threads")})
    return "; ".join(f"{k.split('.')[0]} " + ",".join(f"{r[k]:g}" if k in r else "-" for r in rounds)
                     for k in keys) or "none"


def plot(summaries: Sequence[Summary], path: Path) -> bool:
    """Horizontal bars of every ratio, its target marked; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [s for s in summaries if s.ratio is not None]
    if not shown:
        return False
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.2))
    ys = range(len(shown))
    colors = ["tab:gray" if s.met is None else "tab:green" if s.met else "tab:red" for s in shown]
    ax.barh(list(ys), [s.ratio for s in shown], color=colors)
    for y, s in zip(ys, shown):
        if s.row.goal is not None:
            ax.plot([s.row.goal[1]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax.set_yticks(list(ys), [s.row.label for s in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (black: target; green met, red not met)")
    ax.set_xscale("log")
    marks = [s.ratio for s in shown] + [s.row.goal[1] for s in shown if s.row.goal]
    marks = [m for m in marks if m > 0]
    ax.set_xlim(min(marks) / 1.5, max(marks) * 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_results(res: dict[str, Any], out: Path) -> None:
    (out / "results.json").write_text(json.dumps(plain(res), indent=1))
    (out / "results.md").write_text(markdown(res))
    plot(res["summaries"], out / "results.png")
