"""Rendering for the A/B harness: the table, the PNG chart and the verdict paragraph."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def speedups(rows: list[dict[str, Any]]) -> dict[str, float]:
    """tok/s over the no-speculation run of the same backend and concurrency."""
    base = {(r["backend"], r["concurrency"]): r["tok_s"] for r in rows if r["spec"] is None}
    return {r["setting"]: r["tok_s"] / base[(r["backend"], r["concurrency"])]
            for r in rows if (r["backend"], r["concurrency"]) in base}


def render_table(rows: list[dict[str, Any]], predicted: list[dict[str, Any]]) -> str:
    ups = speedups(rows)
    phase_names = sorted({p for r in rows for p in r["phases_ms"]})
    head = ["setting", "tok/s", "pred", "accept", "speedup", "step ms", "AR ms", "AR wait ms",
            "AR calls"] + phase_names
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cells = [r["setting"], f"{r['tok_s']:.1f}", _fmt(r.get("predicted_tok_s")),
                 _fmt(r.get("accept_length"), 2), _fmt(ups.get(r["setting"]), 2),
                 f"{r['step_ms']:.2f}", f"{r['allreduce_ms_per_step']:.2f}",
                 _fmt(r.get("allreduce_wait_ms_per_step"), 2), f"{r['allreduce_calls_per_step']:.0f}"]
        cells += [_fmt(r["phases_ms"].get(p), 2) for p in phase_names]
        lines.append(" | ".join(cells))
    for p in predicted:
        lines.append(" | ".join([p["setting"], "-", _fmt(p["predicted_tok_s"]),
                                 _fmt(p["accept_length"], 2)] + ["-"] * (len(head) - 4)))
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def verdict(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "No measurements."
    best = max(rows, key=lambda r: r["tok_s"])
    ups = speedups(rows)
    spec_rows = [r for r in rows if r["spec"] is not None]
    text = f"Best setting: {best['setting']} at {best['tok_s']:.1f} tok/s."
    if not spec_rows:
        return text + " No speculative setting was measured."
    top_spec = max(spec_rows, key=lambda r: r["tok_s"])
    gain = ups.get(top_spec["setting"])
    phases = top_spec["phases_ms"]
    limiter = max(phases, key=phases.get) if phases else "unknown"
    share = phases.get(limiter, 0.0) / top_spec["step_ms"] if top_spec["step_ms"] else 0.0
    if gain is not None and gain > 1.0:
        text += (f" Speculation pays: {top_spec['setting']} runs {gain:.2f}x the no-speculation "
                 f"baseline on {top_spec['backend']} (accept length {top_spec['accept_length']:.2f}).")
    elif gain is not None:
        text += (f" Speculation does not pay here: its best setting, {top_spec['setting']}, reaches "
                 f"only {gain:.2f}x the baseline (accept length {top_spec['accept_length']:.2f}).")
    text += (f" The limiting phase of that setting is '{limiter}' ({phases.get(limiter, 0.0):.2f} ms, "
             f"{share:.0%} of a {top_spec['step_ms']:.2f} ms step); allreduces take "
             f"{top_spec['allreduce_ms_per_step']:.2f} ms per step "
             f"({top_spec['allreduce_calls_per_step']:.0f} calls"
             + (f", {top_spec['allreduce_wait_ms_per_step']:.2f} ms of it waiting for a late rank"
                if top_spec.get("allreduce_wait_ms_per_step") else "") + ").")
    return text


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["setting"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    colors = ["#4c72b0" if r["spec"] is None else "#dd8452" for r in rows]
    ax.bar(range(len(rows)), [r["tok_s"] for r in rows], color=colors)
    preds = [(i, r["predicted_tok_s"]) for i, r in enumerate(rows) if r.get("predicted_tok_s")]
    if preds:
        ax.scatter([p[0] for p in preds], [p[1] for p in preds], color="black", marker="x",
                   label="cost model", zorder=3)
        ax.legend()
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tok/s")
    ax.set_title("tpserve A/B: blue = no speculation, orange = EAGLE-3")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
