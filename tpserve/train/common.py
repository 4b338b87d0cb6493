"""Pieces both trainers share: learning-rate schedule, loss plot, device and thread setup."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Budget:
    """Training length: a step count, a wall-clock budget, or both (whichever ends first)."""
    steps: int | None
    minutes: float | None

    def progress(self, step: int, elapsed_s: float) -> float:
        """Fraction done in [0, 1]: the schedule follows whichever limit is nearer."""
        fracs = []
        if self.steps:
            fracs.append(step / self.steps)
        if self.minutes:
            fracs.append(elapsed_s / (60.0 * self.minutes))
        return min(1.0, max(fracs)) if fracs else 1.0


def lr_at(progress: float, peak: float, warmup: float, floor: float = 0.1) -> float:
    """Linear warmup over the first ``warmup`` fraction, then cosine down to floor * peak."""
    if progress < warmup:
        return peak * max(progress / warmup, 1e-3)
    t = (progress - warmup) / max(1e-9, 1.0 - warmup)
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0))))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def setup_threads(device: torch.device, threads: int | None) -> None:
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)


def plot_losses(path: Path, curves: dict[str, list[tuple[int, float]]], title: str) -> None:
    """Loss curves as a PNG (skipped quietly when matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=name, marker="o" if len(points) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def progress_bar(total: int | None, desc: str):  # type: ignore[no-untyped-def]
    """tqdm when available; a no-op stand-in otherwise (training never depends on it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, dynamic_ncols=True, mininterval=2.0)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kw: object) -> None:
        pass

    def close(self) -> None:
        pass
