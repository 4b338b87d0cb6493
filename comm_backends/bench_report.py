"""Presentation of ``comm_backends.bench`` results: the text table, JSON and the PNG plot."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from comm_backends.bench import Report, Result


def human_bytes(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % (scale // 4 or 1) == 0:
            value = n / scale
            return f"{value:g}{unit}"
    return f"{n}B"


def _by_key(report: Report) -> dict[tuple[str, int], Result]:
    return {(r.backend, r.nbytes): r for r in report.results}


def _backends(report: Report) -> list[str]:
    seen: list[str] = []
    for r in report.results:
        if r.backend not in seen:
            seen.append(r.backend)
    return seen


def render_table(report: Report) -> str:
    """One row per size: copy floor, then latency (p90) / bandwidth / speed-up per backend."""
    names = _backends(report)
    sizes = sorted({r.nbytes for r in report.results})
    results = _by_key(report)
    head = [f"{'size':>6}", f"{'copy us':>8}"]
    for i, name in enumerate(names):
        head.append(f"{name + ' us (p90)':>22} {'GB/s':>7}" + (f" {'x ' + names[0]:>9}" if i else ""))
    lines = [
        f"allreduce {report.dtype}, world {report.world}, {report.threads} thread(s)/rank; "
        "us = slowest rank's median (p90); GB/s = bytes / median; "
        f"x {names[0] if names else '-'} = its median / this median",
        " | ".join(head),
    ]
    for nbytes in sizes:
        row = [f"{human_bytes(nbytes):>6}", f"{report.copy_floor_us.get(nbytes, math.nan):>8.1f}"]
        base = results.get((names[0], nbytes))
        for i, name in enumerate(names):
            row.append(_cell(results.get((name, nbytes)), base if i else None))
        lines.append(" | ".join(row))
    for r in report.results:
        if not r.correct:
            lines.append(f"WRONG RESULT: {r.backend} at {human_bytes(r.nbytes)} (max abs err {r.max_abs_err:g})")
    if all(r.correct for r in report.results):
        lines.append(f"correctness: all {len(report.results)} (backend, size) pairs match the fp64 reference "
                     "and are bit-identical across ranks")
    for r in report.results:
        if r.parts_us:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r.parts_us.items())
            lines.append(f"{r.backend} at {human_bytes(r.nbytes)}, us per call (rank 0): {parts}")
    for name, reason in report.skipped.items():
        lines.append(f"skipped {name}: {reason}")
    return "\n".join(lines)


def _cell(result: Result | None, base: Result | None) -> str:
    if result is None:
        return f"{'-':>22} {'-':>7}" + (f" {'-':>9}" if base is not None else "")
    flag = "" if result.correct else "!"
    latency = f"{result.median_us:.1f} ({result.p90_us:.1f}){flag}"
    gbps = result.nbytes / (result.median_us * 1e-6) / 1e9
    cell = f"{latency:>22} {gbps:>7.2f}"
    if base is not None:
        cell += f" {base.median_us / result.median_us:>8.1f}x"
    return cell


def write_json(data: dict[str, Any], path: str) -> None:
    # JSON object keys must be strings; keep sizes readable as numbers in the values instead.
    data = dict(data)
    data["copy_floor_us"] = {str(k): v for k, v in data.get("copy_floor_us", {}).items()}
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def write_plot(report: Report, path: str) -> None:
    """Log-log latency vs size, one line per backend plus the copy floor."""
    import matplotlib  # lazy: plotting is optional and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    results = _by_key(report)
    sizes = sorted({r.nbytes for r in report.results})
    for name in _backends(report):
        pts = [(n, results[(name, n)].median_us) for n in sizes if (name, n) in results]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    floor = [(n, report.copy_floor_us[n]) for n in sizes if n in report.copy_floor_us]
    if floor:
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="copy floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [human_bytes(n) for n in sizes], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("latency, slowest rank median (us)")
    ax.set_title(f"allreduce {report.dtype}, {report.world} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
