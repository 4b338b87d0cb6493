"""Where a decode step's time goes: host phases, the busiest host calls, and the device.

``python -m launch.step_profile --model DIR [--device cuda] [--batch 1] [--steps 32]``
decodes greedily at one batch size (offline, no HTTP) and reports, per decode step:

- the wall time with no profiler attached (the figure to compare against a bandwidth limit);
- the engine's own phases (``StepProfiler``: plan, decode, sample, output, ...), host clock;
- under ``torch.profiler``, the host calls with the most self time (on CUDA these include the
  runtime API: kernel and graph launches, copies, synchronisations) and, on CUDA, the time
  the device spent in kernels. Wall time minus device time is what the GPU waited for the
  host: the part a step's graph cannot hide.

The GPU decode table (``launch.gpu_decode_table``) found graph decode of a ~1B Llama at batch 1
taking 2.8 ms a step where its weights take 0.66 ms to read; this is the tool that says where
the rest goes, in one short run on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tpserve.args import ServerArgs
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine

WARM_STEPS = 4


@dataclass(frozen=True)
class HostCall:
    name: str
    calls_per_step: float
    self_us_per_step: float


@dataclass
class StepProfile:
    batch: int
    steps: int
    device: str
    wall_ms: float  # per decode step, no torch.profiler attached
    phases_ms: dict[str, float] = field(default_factory=dict)  # StepProfiler, per step
    phase_coverage: float | None = None
    profiled_wall_ms: float = 0.0  # per step under torch.profiler (its overhead included)
    device_ms: float | None = None  # kernel time per step (CUDA only)
    top_host: list[HostCall] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"decode step profile: batch {self.batch}, {self.steps} steps, {self.device}",
               f"  wall {self.wall_ms:.3f} ms/step (no profiler); "
               f"{self.profiled_wall_ms:.3f} under torch.profiler"]
        if self.device_ms is not None:
            idle = max(0.0, self.profiled_wall_ms - self.device_ms)
            out.append(f"  device kernels {self.device_ms:.3f} ms/step; the device waited "
                       f"{idle:.3f} ms/step for the host (profiled)")
        coverage = "" if self.phase_coverage is None else f" (cover {self.phase_coverage:.0%})"
        out.append("  phases ms/step" + coverage + ": " + ", ".join(
            f"{name} {ms:.3f}" for name, ms in sorted(self.phases_ms.items(),
                                                       key=lambda kv: -kv[1])))
        out.append("  host calls by self time (calls/step, us/step):")
        out.extend(f"    {c.name[:60]:<60} {c.calls_per_step:7.1f} {c.self_us_per_step:9.1f}"
                   for c in self.top_host)
        return out


def _start(engine: OfflineEngine, batch: int, steps: int) -> None:
    """``batch`` greedy requests admitted and prefilled, with tokens for ``steps`` more."""
    eng = engine.engine
    params = SamplingParams(max_new_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.scheduler.add(engine.request([1, 2, 3, 4 + i], params, {}))
    while (step_batch := eng.next_batch()) is not None:  # the prompts: a step each at most
        eng.step(step_batch)
        if step_batch.kind == "decode":
            return


def _decode(engine: OfflineEngine, steps: int) -> float:
    """Seconds for ``steps`` decode steps, each run as the server's loop runs it
    (``Engine.step_next``: timed by the engine's profiler when that is on)."""
    sync = torch.cuda.synchronize if engine.built.runner.device.type == "cuda" else (lambda: None)
    sync()
    begin = time.perf_counter()
    for _ in range(steps):
        if not engine.engine.step_next():
            raise RuntimeError("the requests finished before the profiled steps did")
    sync()
    return time.perf_counter() - begin


def _top_host(prof: Any, steps: int, top: int) -> list[HostCall]:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [HostCall(e.key, e.count / steps, e.self_cpu_time_total / steps) for e in events[:top]]


def _device_ms(prof: Any, steps: int) -> float:
    total_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    return total_us / 1e3 / steps


def profile_decode(engine: OfflineEngine, batch: int, steps: int, top: int = 15) -> StepProfile:
    """Three stretches of ``steps`` decode steps of one batch: plain, with the engine's phase
    timers, and under ``torch.profiler``. The engine must be idle; it is again afterwards."""
    import torch.profiler as tp

    eng = engine.engine
    _start(engine, batch, WARM_STEPS + 3 * steps)
    _decode(engine, WARM_STEPS)
    wall = _decode(engine, steps)
    was_enabled = eng.profiler.enabled
    eng.profiler.enabled = True
    eng.profiler.reset()
    try:
        _decode(engine, steps)
        snap = eng.profiler.snapshot()
    finally:
        eng.profiler.enabled = was_enabled
    cuda = engine.built.runner.device.type == "cuda"
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
    with tp.profile(activities=activities) as prof:
        profiled = _decode(engine, steps)
    while eng.step_next():  # the last tokens: leave the engine idle
        pass
    return StepProfile(
        batch=batch, steps=steps, device=str(engine.built.runner.device),
        wall_ms=1e3 * wall / steps,
        phases_ms={name: p["ms_per_step"] for name, p in snap["phases"].items()},
        phase_coverage=snap["phase_coverage"], profiled_wall_ms=1e3 * profiled / steps,
        device_ms=_device_ms(prof, steps) if cuda else None,
        top_host=_top_host(prof, steps, top))


def main(argv: list[str] | None = None) -> StepProfile:
    ap = argparse.ArgumentParser(prog="launch.step_profile")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    engine = OfflineEngine(ServerArgs(
        model=args.model, device=args.device, attention_backend=args.attention_backend,
        max_running_requests=max(args.batch, 1), cuda_graph_max_bs=max(args.batch, 1),
        disable_cuda_graph=args.disable_cuda_graph))
    try:
        result = profile_decode(engine, args.batch, args.steps)
    finally:
        engine.close()
    print("\n".join(result.lines()))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=2))
    return result


if __name__ == "__main__":
    main()
