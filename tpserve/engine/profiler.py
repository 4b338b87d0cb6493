"""Where each engine step's time goes: wall time per phase and allreduces per phase.

Rank 0 wraps each part of a step (schedule, control message, draft, verify, decode forward,
sampling, accept, ...) in ``profiler.phase(name)``. Entering a phase also tags the allreduce
statistics with that name, so every collective is attributed to the phase that issued it,
whether or not timing is on. Timing itself is opt-in (``--enable-profiling`` or live via
``/admin/config``); while off, ``phase`` returns a shared no-op context.

On CUDA the phase clock reads host time; kernels still in flight are charged to whichever
phase synchronises next (sampling, usually). That is the honest host-side view; use
``/admin/profile`` for a device-side trace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from tpserve.engine.trace_files import write_private

_NOOP: AbstractContextManager[None] = nullcontext()


class PhaseTagged(Protocol):
    def set_phase(self, phase: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...


@dataclass
class StepProfiler:
    comm: PhaseTagged | None = None
    enabled: bool = False
    steps: int = 0
    step_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    phase_entries: dict[str, int] = field(default_factory=dict)
    _baseline: dict[str, Any] = field(default_factory=dict)

    def phase(self, name: str) -> AbstractContextManager[None]:
        if self.comm is not None:
            self.comm.set_phase(name)
        return self._timed(name) if self.enabled else _NOOP

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.perf_counter() - start
            self.phase_entries[name] = self.phase_entries.get(name, 0) + 1

    def record(self, name: str, seconds: float, entry: bool = True) -> None:
        """Charge time measured elsewhere (e.g. by the speculative worker) to a phase;
        without ``entry``, as more of a phase this step already entered."""
        if self.enabled:
            self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds
            self.phase_entries[name] = self.phase_entries.get(name, 0) + int(entry)

    def step(self, start: float | None = None) -> AbstractContextManager[None]:
        """Wraps one whole engine step (the reference the phases must add up to).

        ``start`` lets the caller include work done just before entering (scheduling).
        """
        return self._step(start or time.perf_counter()) if self.enabled else _NOOP

    @contextmanager
    def _step(self, start: float) -> Iterator[None]:
        try:
            yield
        finally:
            self.steps += 1
            self.step_seconds += time.perf_counter() - start

    def reset(self) -> None:
        self.steps, self.step_seconds = 0, 0.0
        self.phase_seconds.clear()
        self.phase_entries.clear()
        self._baseline = self.comm.stats() if self.comm is not None else {}

    def snapshot(self) -> dict[str, Any]:
        steps = max(1, self.steps)
        phases = {name: {"ms_per_step": 1e3 * sec / steps, "entries": self.phase_entries[name]}
                  for name, sec in sorted(self.phase_seconds.items())}
        covered = sum(self.phase_seconds.values())
        return {
            "enabled": self.enabled,
            "steps": self.steps,
            "step_ms_avg": 1e3 * self.step_seconds / steps,
            "phases": phases,
            "phase_coverage": covered / self.step_seconds if self.step_seconds else None,
            "allreduce": self.allreduce_by_phase(steps),
        }

    def allreduce_by_phase(self, steps: int) -> dict[str, dict[str, float]]:
        """Allreduce calls, ms and ms waiting for a late rank per step, per phase, since the
        last reset (all backends)."""
        if self.comm is None:
            return {}
        out: dict[str, dict[str, float]] = {}
        for backend, snap in self.comm.stats().items():
            base = self._baseline.get(backend, {}).get("by_phase", {})
            for phase, entry in snap["by_phase"].items():
                prev = base.get(phase, {"calls": 0, "seconds": 0.0, "waited_seconds": 0.0})
                agg = out.setdefault(phase, {"calls": 0.0, "ms": 0.0, "wait_ms": 0.0})
                agg["calls"] += entry["calls"] - prev["calls"]
                agg["ms"] += 1e3 * (entry["seconds"] - prev["seconds"])
                agg["wait_ms"] += 1e3 * (entry["waited_seconds"] - prev["waited_seconds"])
        return {p: {"calls_per_step": v["calls"] / steps, "ms_per_step": v["ms"] / steps,
                    "wait_ms_per_step": v["wait_ms"] / steps, "calls": v["calls"]}
                for p, v in out.items()}


@dataclass
class TraceCapture:
    """A ``torch.profiler`` trace of the next N engine steps, written as a Chrome trace.

    ``path`` must lie in a private directory (``trace_files``); the file is replaced
    atomically, never written through a symlink.
    """

    steps_left: int
    path: str
    profiler: Any
    done: bool = False
    error: str | None = None

    @classmethod
    def start(cls, steps: int, path: str) -> TraceCapture:
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU]
        import torch

        if torch.cuda.is_available():
            activities.append(tp.ProfilerActivity.CUDA)
        prof = tp.profile(activities=activities, record_shapes=False)
        prof.__enter__()
        return cls(steps, path, prof)

    def tick(self) -> bool:
        """Count one step; on the last one, stop and write the file. True when finished."""
        self.steps_left -= 1
        if self.steps_left > 0:
            return False
        try:
            self.profiler.__exit__(None, None, None)
            write_private(self.path, self.profiler.export_chrome_trace)
        except Exception as exc:  # a failed trace must never take the engine down
            self.error = str(exc)
        self.done = True
        return True
