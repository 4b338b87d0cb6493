"""Allreduce micro-benchmark: correctness, then latency per size per backend.

    torchrun --nproc-per-node 4 -m comm_backends.bench --backends gloo,shm --sizes 4K,64K,1M
    python -m comm_backends.bench --spawn 4 --backends gloo,shm --decode-sizes --plot ar.png

Every rank checks each backend against a float64 reference (each rank rebuilds every rank's
seeded input locally, so the check needs no communication) and that all ranks got the same
bits, then times it. Rank 0 prints one table, and optionally writes JSON and a PNG.
Owns the measurement protocol; formatting lives in ``bench_report``.

Exit status: non-zero when a requested backend was skipped (refused, or failed to set up)
unless it is listed in ``--optional``, or when any result is wrong. Across nodes (torchrun
--nnodes N), ``--backends gloo,hier`` prints the hierarchical backend against the flat one,
with hier's local / cross-node / broadcast parts per size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import comm_backends
from comm_backends.base import AllReduce, BackendUnavailable
from comm_backends.bench_report import render_table, write_json, write_plot
from comm_backends.topology import Topology

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CUDA_BACKENDS = ("nccl", "cuda_p2p", "symm_mem")
BOTH_DEVICES = ("hier",)  # runs on the run's device: CUDA when any CUDA backend is asked for
DECODE_HIDDEN = (4096, 7168)
DECODE_BATCH = (1, 8, 32)
CALLS_PER_BARRIER = 10  # timed calls between barriers; the first after a barrier is dropped


@dataclass
class BenchArgs:
    backends: list[str]
    sizes: list[int]
    dtype: str = "bf16"
    iters: int = 200
    warmup: int = 10
    max_seconds: float = 3.0  # per backend per size: caps iters for slow (size, backend) pairs
    threads: int = 1
    pin: bool = False  # pin rank i to CPU i mod n: keeps the scheduler from stacking ranks
    json: str | None = None
    plot: str | None = None
    optional: list[str] = field(default_factory=list)  # may be skipped without failing the run


@dataclass
class Result:
    backend: str
    nbytes: int
    correct: bool
    max_abs_err: float
    median_us: float = float("nan")
    p90_us: float = float("nan")
    iters: int = 0
    parts_us: dict[str, float] = field(default_factory=dict)  # composite backends, mean per call


@dataclass
class Report:
    world: int
    dtype: str
    threads: int
    results: list[Result] = field(default_factory=list)
    copy_floor_us: dict[int, float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def decode_sizes(itemsize: int) -> list[int]:
    return [h * b * itemsize for h in DECODE_HIDDEN for b in DECODE_BATCH]


def _seeded_input(rank: int, numel: int, dtype: torch.dtype, call: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1_000_003 * rank + 7919 * call + numel)
    return torch.randn(numel, generator=gen).to(dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(backend: AllReduce, numel: int, dtype: torch.dtype) -> tuple[bool, float]:
    """Compare with a float64 sum of every rank's input, and require identical bits everywhere."""
    world = backend.world_size
    reference = torch.zeros(numel, dtype=torch.float64)
    magnitude = torch.zeros(numel, dtype=torch.float64)
    for rank in range(world):
        x = _seeded_input(rank, numel, dtype, 0)
        reference += x.double()
        magnitude += x.double().abs()
        if rank == backend.rank:
            mine = x
    out = backend.all_reduce(mine.to(backend.device))
    _sync(backend.device)
    err = (out.cpu().double() - reference).abs()
    # Per element: one rounding to the output dtype plus fp32 accumulation error, both bounded by
    # world * eps * sum|x|; stale or misplaced data is off by O(|x|) and fails this.
    tol = world * torch.finfo(dtype).eps * magnitude
    digest = hashlib.sha1(out.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, digest)
    return bool((err <= tol).all()) and len(set(digests)) == 1, err.max().item()


def _agree_iters(args: BenchArgs, probe_s: float) -> int:
    """Rank 0 picks the iteration count from its warm-up; everyone uses it (must match)."""
    budget = max(CALLS_PER_BARRIER, int(args.max_seconds / max(probe_s, 1e-7)))
    choice = [min(args.iters, budget)]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def time_calls(call: Callable[[], object], device: torch.device, args: BenchArgs) -> list[float]:
    """Per-call seconds; ranks re-align with a barrier every CALLS_PER_BARRIER calls."""
    start = time.perf_counter()
    for _ in range(args.warmup):
        call()
    _sync(device)
    iters = _agree_iters(args, (time.perf_counter() - start) / max(args.warmup, 1))
    samples: list[float] = []
    while len(samples) < iters:
        dist.barrier()
        for i in range(CALLS_PER_BARRIER + 1):
            t0 = time.perf_counter()
            call()
            _sync(device)
            if i:  # the first call after a barrier mostly measures barrier-exit skew
                samples.append(time.perf_counter() - t0)
    return samples


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _slowest_rank(value: float) -> float:
    # A collective step finishes when its slowest rank does.
    values: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return max(v for v in values if v is not None)


def measure(backend: AllReduce, nbytes: int, dtype: torch.dtype, args: BenchArgs) -> Result:
    numel = max(1, nbytes // dtype.itemsize)
    ok, err = check(backend, numel, dtype)
    # Zeros stay zeros under repeated in-place sums (random data would overflow to inf/NaN
    # after a few dozen calls); float timing on these backends does not depend on the values.
    x = torch.zeros(numel, dtype=dtype, device=backend.device)
    backend.stats.reset()
    samples = time_calls(lambda: backend.all_reduce(x), backend.device, args)
    try:
        backend.check()  # e.g. a cuda_p2p kernel that gave up waiting during the timed calls
    except RuntimeError as exc:
        print(f"rank {dist.get_rank()}: {backend.name}: {exc}", file=sys.stderr, flush=True)
        ok = False
    ok = bool(_slowest_rank(float(not ok)) == 0.0)  # wrong on any rank is wrong
    median = _slowest_rank(statistics.median(samples))
    p90 = _slowest_rank(_percentile(samples, 0.9))
    parts = {k: v[1] / v[0] * 1e6 for k, v in backend.stats.parts.items() if v[0]}
    return Result(backend.name, nbytes, ok, err, median * 1e6, p90 * 1e6, len(samples), parts)


def copy_floor(nbytes: int, device: torch.device, args: BenchArgs) -> float:
    """Median microseconds of one same-size torch copy, all ranks copying at once."""
    src = torch.ones(max(1, nbytes), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    samples = time_calls(lambda: dst.copy_(src), device, args)
    return _slowest_rank(statistics.median(samples)) * 1e6


def _wants_cuda(names: list[str]) -> bool:
    return any(n in CUDA_BACKENDS for n in names) and torch.cuda.is_available()


def _device_for(name: str, names: list[str]) -> torch.device:
    if _wants_cuda(names) and (name in CUDA_BACKENDS or name in BOTH_DEVICES):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_backends(names: list[str], dtype: torch.dtype, report: Report) -> list[AllReduce]:
    """The backends every rank can build. Ranks agree on the refusals first (and a set-up
    failure is raised on every rank by the backend itself), so no rank times a backend that
    another skipped."""
    views: dict[torch.device, tuple[Topology, dict[str, str]]] = {}
    built = []
    for name in names:
        device = _device_for(name, names)
        if device not in views:
            views[device] = comm_backends.agree_on(comm_backends.measure_here(device, None, dtype))
        topo, refused = views[device]
        try:
            chosen = comm_backends.choose(topo, refused).name if name == "auto" else name
            if chosen in refused:
                raise BackendUnavailable(refused[chosen])
            backend = comm_backends.create(chosen, None, device, topo)
        except BackendUnavailable as exc:
            report.skipped[name] = str(exc)
            continue
        if dtype in backend.dtypes:
            built.append(backend)
        else:
            report.skipped[name] = f"does not support {dtype}"
            backend.close()
    return built


def _pin(rank: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def run(args: BenchArgs) -> Report:
    torch.set_num_threads(args.threads)
    if args.pin:
        _pin(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    dtype = DTYPES[args.dtype]
    report = Report(dist.get_world_size(), args.dtype, args.threads)
    backends = build_backends(args.backends, dtype, report)
    floor_device = backends[0].device if backends else torch.device("cpu")
    for nbytes in args.sizes:
        # Interleave backends per size so slow drift of a shared machine hits all alike.
        for backend in backends:
            report.results.append(measure(backend, nbytes, dtype, args))
        report.copy_floor_us[nbytes] = copy_floor(nbytes, floor_device, args)
    for backend in backends:
        backend.close()
    return report


def _init_process_group(args: BenchArgs) -> None:
    wants_cuda = _wants_cuda(args.backends)
    if wants_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("cpu:gloo,cuda:nccl" if wants_cuda else "gloo")


def failures(report: Report, optional: list[str]) -> list[str]:
    """Why the run failed (empty: it passed): wrong results, and required backends skipped."""
    found = [f"WRONG: {r.backend} at {r.nbytes} bytes" for r in report.results if not r.correct]
    found += [f"SKIPPED (required): {name}: {why}" for name, why in report.skipped.items()
              if name not in optional]
    return found


def main_rank(args: BenchArgs) -> int:
    _init_process_group(args)
    try:
        report = run(args)
        problems = failures(report, args.optional)
        if dist.get_rank() == 0:
            print(render_table(report), flush=True)
            for line in problems:
                print(line, file=sys.stderr, flush=True)
            if args.json:
                write_json({**asdict(report), "failures": problems}, args.json)
            if args.plot:
                write_plot(report, args.plot)
        return 1 if problems else 0
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, world: int, port: int, args: BenchArgs) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    code = main_rank(args)
    if code:
        sys.exit(code)


def spawn(world: int, args: BenchArgs) -> int:
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port, chosen now: never a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_spawned_rank, args=(world, port, args), nprocs=world)
    except mp.ProcessExitedException as exc:
        return exc.exit_code or 1
    return 0


def parse_args(argv: list[str] | None = None) -> tuple[BenchArgs, int]:
    p = argparse.ArgumentParser(prog="python -m comm_backends.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="gloo,shm", help="comma list, first is the baseline")
    p.add_argument("--sizes", default="4K,8K,14K,64K,256K,1M,8M", help="bytes, K/M suffix")
    p.add_argument("--decode-sizes", action="store_true", help="add hidden {4096,7168} x batch {1,8,32}")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=3.0, help="time cap per backend per size")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--pin", action="store_true", help="pin rank i to CPU i mod #cpus")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="latency-vs-size PNG")
    p.add_argument("--spawn", type=int, default=0, help="start N local ranks instead of torchrun")
    p.add_argument("--optional", default="",
                   help="comma list of backends that may be skipped (refused) without failing")
    ns = p.parse_args(argv)
    sizes = [parse_size(s) for s in ns.sizes.split(",") if s.strip()]
    if ns.decode_sizes:
        sizes += decode_sizes(DTYPES[ns.dtype].itemsize)
    args = BenchArgs(
        backends=[b.strip() for b in ns.backends.split(",") if b.strip()],
        sizes=sorted(set(sizes)), dtype=ns.dtype, iters=ns.iters, warmup=ns.warmup,
        max_seconds=ns.max_seconds, threads=ns.threads, pin=ns.pin, json=ns.json, plot=ns.plot,
        optional=[b.strip() for b in ns.optional.split(",") if b.strip()],
    )
    return args, ns.spawn


def main(argv: list[str] | None = None) -> int:
    args, world = parse_args(argv)
    if world:
        return spawn(world, args)
    if "RANK" in os.environ:
        return main_rank(args)
    print("run under torchrun, or pass --spawn N", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
