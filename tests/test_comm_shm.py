"""CPU allreduce backends (gloo, shm): correctness, bit-identity, isolation, failure, cleanup.

Every multi-rank test starts one process group per world size and runs many cases inside it;
children fork from a forkserver that has already imported torch, so a start costs
milliseconds, not a torch import per rank.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm_backends
from comm_backends.base import AllReduce, BackendUnavailable
from comm_backends.shm import ShmAllReduce, ShmConfig
from comm_backends.shm_segment import SegmentRef, create_segment, map_segment

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Small buffer: 8 KiB halves, so chunking starts at 8 KiB; two-shot from 2 KiB.
SMALL = ShmConfig(buffer_bytes=16 << 10, two_shot_bytes=2 << 10, timeout_s=30.0)
SHAPES_SMALL = ((1,), (3,), (17,), (5, 7), (513,), (1000,), (1023,), (2049,), (4096,), (9001,), (3, 4099))
# (513,) in fp32 under SMALL: two-shot segments of 80 elements leave rank 7 an empty segment.
SHAPES_LARGE = ((1,), (333,), (40_000,), (131_071,), (1_000_003,))
SHAPES_LONG_ROWS = ((40_000,), (2, 20_000), (131_071,))  # one-shot's fp32 loop for >2 ranks


# ---------------------------------------------------------------------------- process harness
def _entry(rank: int, world: int, store: str, fn: Callable[..., Any], kwargs: dict, out: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        out.put((rank, "ok", fn(rank, world, **kwargs)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_world(world: int, fn: Callable[..., Any], tmp: Path, **kwargs: Any) -> tuple[list, Any]:
    """Start ``fn(rank, world, **kwargs)`` on ``world`` fresh processes (a new job)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "comm_backends.shm"])
    out = ctx.Queue()
    store = str(tmp / f"store_{fn.__name__}_{time.monotonic_ns()}")
    procs = [ctx.Process(target=_entry, args=(r, world, store, fn, kwargs, out)) for r in range(world)]
    for p in procs:
        p.start()
    return procs, out


def collect(job: tuple[list, Any], reports: int | None = None, timeout: float = 150.0) -> dict[int, Any]:
    """Results by rank; ``reports`` is how many ranks answer (fewer when a test kills one)."""
    procs, out = job
    results: dict[int, Any] = {}
    try:
        for _ in range(len(procs) if reports is None else reports):
            rank, status, value = out.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def run_world(
    world: int, fn: Callable[..., Any], tmp: Path, reports: int | None = None, **kwargs: Any
) -> dict[int, Any]:
    return collect(start_world(world, fn, tmp, **kwargs), reports)


# ---------------------------------------------------------------------------- rank-side helpers
def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every rank's input for case ``seed`` (each rank rebuilds all of them: no comm needed)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(world, *shape, generator=gen).to(dtype)


def _check_case(backend: AllReduce, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> str:
    """All-reduce one case; assert it matches fp64 within dtype tolerance; return its digest."""
    world = backend.world_size
    inputs = _inputs(world, shape, dtype, seed)
    out = backend.all_reduce(inputs[backend.rank].clone())
    assert out.shape == inputs.shape[1:] and out.dtype == dtype
    exact = inputs.double().sum(0)
    # fp32 accumulation plus one rounding: within world * eps * sum|x| per element.
    tol = world * torch.finfo(dtype).eps * inputs.double().abs().sum(0)
    err = (out.double() - exact).abs()
    assert bool((err <= tol).all()), (
        f"{backend.name} {dtype} {shape}: max err {err.max().item():.3g} (tol {tol.max().item():.3g})"
    )
    return hashlib.sha1(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _assert_same_everywhere(digests: list[str], group: dist.ProcessGroup | None = None) -> None:
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, digests, group=group)
    for rank, theirs in enumerate(gathered):
        assert theirs == digests, f"rank {rank} got different bits"


def _segments_of(pid: int) -> list[str]:
    """Anything in /dev/shm that names ``pid`` (segments are nameless memfds: always none)."""
    return [n for n in os.listdir("/dev/shm") if str(pid) in n]


# ---------------------------------------------------------------------------- scenarios
def _scenario_correctness(rank: int, world: int) -> dict[str, Any]:
    cpu = torch.device("cpu")
    everything, chunked = SHAPES_SMALL + SHAPES_LARGE, SHAPES_SMALL + ((70_001,),)
    cases: dict[str, tuple[AllReduce, tuple[tuple[int, ...], ...]]] = {
        "gloo": (comm_backends.create("gloo", None, cpu), everything),
        "shm": (comm_backends.create("shm", None, cpu), everything),
        "two-shot, chunked": (ShmAllReduce(None, cpu, SMALL), chunked),
        "one-shot, chunked": (ShmAllReduce(None, cpu, replace(SMALL, two_shot_bytes=1 << 40)), chunked),
        "one-shot, long rows": (ShmAllReduce(None, cpu, ShmConfig(two_shot_bytes=1 << 40)),
                                SHAPES_LONG_ROWS),
        # The torch-op reduction (no compiler, or TPSERVE_SHM_NATIVE=0), both algorithms.
        "torch ops, one-shot": (ShmAllReduce(None, cpu, ShmConfig(native=False, two_shot_bytes=1 << 40)),
                                SHAPES_SMALL + SHAPES_LONG_ROWS),
        "torch ops, two-shot": (ShmAllReduce(None, cpu, replace(SMALL, native=False)), chunked),
    }
    assert backends_native(cases) == [True] * 5 + [False] * 2
    backends = {name: backend for name, (backend, _) in cases.items()}
    digests: list[str] = []
    seed = 0
    for backend, shapes in cases.values():
        for dtype in DTYPES:
            for shape in shapes:
                seed += 1
                digests.append(_check_case(backend, shape, dtype, seed))
    # A non-contiguous input is reduced in place like any other.
    seed += 1
    inputs = _inputs(world, (6, 10), torch.float32, seed)
    mine = inputs[rank].clone().t()
    backends["shm"].all_reduce(mine)
    assert torch.allclose(mine, inputs.sum(0).t(), atol=1e-5)
    _assert_same_everywhere(digests)
    pid0 = os.getpid() if rank == 0 else None
    handed_back = [0, 0, 0]
    for backend in backends.values():
        for stage, count in enumerate(getattr(backend, "handed_back", ())):
            handed_back[stage] += count
        backend.close()
    return {"cases": len(digests), "pid": pid0, "handed_back": handed_back}


def backends_native(cases: dict[str, tuple[AllReduce, Any]]) -> list[bool]:
    """Which shm backends reduce with the compiled kernel (gloo counts as 'True': n/a)."""
    return [getattr(b, "_native", True) is not None if isinstance(b, ShmAllReduce) else True
            for b, _ in cases.values()]


def _scenario_back_to_back(rank: int, world: int) -> int:
    """Many calls with sizes changing every call, alternating two groups' backends."""
    cpu = torch.device("cpu")
    ranks = list(range(world))
    groups = [dist.new_group(ranks, backend="gloo"), dist.new_group(ranks, backend="gloo")]
    pair = [ShmAllReduce(groups[0], cpu, SMALL), ShmAllReduce(groups[1], cpu)]
    sizes = torch.randint(1, 40_000, (120,), generator=torch.Generator().manual_seed(7)).tolist()
    digests = []
    for i, n in enumerate(sizes):
        digests.append(_check_case(pair[i % 2], (n,), DTYPES[i % 3], 10_000 + i))
    _assert_same_everywhere(digests)
    for backend in pair:
        backend.close()
    return len(digests)


def _scenario_concurrent_job(rank: int, world: int, tag: int) -> int:
    backend = ShmAllReduce(None, torch.device("cpu"), SMALL)
    digests = [_check_case(backend, (n,), torch.float32, 1000 * tag + n) for n in range(1, 3000, 97)]
    _assert_same_everywhere(digests)
    backend.close()
    return len(digests)


def _scenario_killed_peer(rank: int, world: int, victim: int) -> dict[str, Any]:
    backend = ShmAllReduce(None, torch.device("cpu"), ShmConfig(timeout_s=60.0))
    pid0 = os.getpid()
    for i in range(20):
        _check_case(backend, (1000 + i,), torch.float32, i)
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        for _ in range(1000):
            backend.all_reduce(torch.ones(4096))
    return {"seconds": time.monotonic() - start, "error": str(info.value), "pid": pid0}


def _scenario_timeout(rank: int, world: int) -> dict[str, Any]:
    backend = ShmAllReduce(None, torch.device("cpu"), ShmConfig(timeout_s=0.5))
    backend.all_reduce(torch.ones(10))
    if rank == 1:
        time.sleep(2.0)  # alive but absent: rank 0 must time out, then rank 1 must fail fast
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        # Rank 1's first call may still complete (rank 0 had published before giving up).
        for _ in range(3):
            backend.all_reduce(torch.ones(10))
    return {"seconds": time.monotonic() - start, "error": str(info.value)}


def _scenario_interrupted(rank: int, world: int) -> str:
    backend = ShmAllReduce(None, torch.device("cpu"), ShmConfig(timeout_s=30.0))
    backend.all_reduce(torch.ones(10))
    if rank == 1:
        def interrupted(seq: int) -> None:
            raise KeyboardInterrupt
        backend._board.wait_all = interrupted  # Ctrl-C while waiting inside a call
        with pytest.raises(KeyboardInterrupt):
            backend.all_reduce(torch.ones(10))
        with pytest.raises(RuntimeError, match="interrupted"):
            backend.all_reduce(torch.ones(10))  # this rank is out of step now: refuse
        return "refused"
    # Arrive late, so that rank 1's wait is a real one: the compiled exchange only hands a wait
    # to FlagBoard.wait_all (patched above) when a peer is not there within a short spin.
    time.sleep(0.2)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        for _ in range(3):
            backend.all_reduce(torch.ones(10))
    assert time.monotonic() - start < 5.0
    return str(info.value)


def _scenario_wait_accounting(rank: int, world: int) -> list[tuple[float, float]]:
    """Rank 1 arrives 0.2 s late to one call: rank 0's stats must put that in ``waited``."""
    cpu = torch.device("cpu")
    out = []
    for backend in (ShmAllReduce(None, cpu), ShmAllReduce(None, cpu, ShmConfig(native=False))):
        backend.all_reduce(torch.ones(1000))
        backend.stats.reset()
        dist.barrier()
        if rank == 1:
            time.sleep(0.2)
        backend.all_reduce(torch.ones(1000))
        out.append((backend.stats.waited, backend.stats.seconds))
        snap = backend.stats.snapshot()
        assert snap["waited_seconds"] == snap["by_phase"]["other"]["waited_seconds"] == backend.stats.waited
        backend.close()
    return out


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 4, 8])
def test_gloo_and_shm_match_reference_and_are_bit_identical(world: int, tmp_path: Path) -> None:
    results = run_world(world, _scenario_correctness, tmp_path)
    assert results[0]["cases"] > 100
    if world == 8:
        # 8 ranks share this machine's few cores, so the compiled exchange must have handed
        # waits of both rounds back to FlagBoard and resumed: that path was checked too.
        _, first, second = (sum(r["handed_back"][i] for r in results.values()) for i in range(3))
        assert first > 0 and second > 0, (first, second)
    assert _segments_of(results[0]["pid"]) == []  # nothing left after a normal exit


def test_time_waiting_for_a_late_rank_is_reported(tmp_path: Path) -> None:
    results = run_world(2, _scenario_wait_accounting, tmp_path)
    for waited, seconds in results[0]:  # compiled exchange, then torch ops
        assert 0.15 <= waited <= seconds, (waited, seconds)


def test_back_to_back_varying_sizes_on_two_groups(tmp_path: Path) -> None:
    assert set(run_world(3, _scenario_back_to_back, tmp_path).values()) == {120}


def test_two_jobs_on_one_host_do_not_collide(tmp_path: Path) -> None:
    jobs = [start_world(2, _scenario_concurrent_job, tmp_path, tag=t) for t in range(2)]
    for job in jobs:
        assert set(collect(job).values()) == {31}


def test_killed_rank_makes_peers_fail_fast_and_leaves_no_segment(tmp_path: Path) -> None:
    results = run_world(3, _scenario_killed_peer, tmp_path, reports=2, victim=2)
    for rank in (0, 1):
        assert "rank 2" in results[rank]["error"], results[rank]["error"]
        assert results[rank]["seconds"] < 10.0
    assert _segments_of(results[0]["pid"]) == []


def test_absent_peer_times_out_and_the_abort_reaches_it(tmp_path: Path) -> None:
    results = run_world(2, _scenario_timeout, tmp_path)
    assert "timed out" in results[0]["error"] and results[0]["seconds"] < 5.0
    assert "rank 0 aborted" in results[1]["error"] and results[1]["seconds"] < 1.0


def test_interrupted_rank_makes_peers_fail_fast(tmp_path: Path) -> None:
    results = run_world(2, _scenario_interrupted, tmp_path)
    assert results[1] == "refused"
    assert "rank 1 aborted its allreduce (interrupted)" in results[0], results[0]


def test_world_of_one_needs_no_segment() -> None:
    backend = comm_backends.create("shm", None, torch.device("cpu"))
    x = torch.arange(5.0)
    assert backend.all_reduce(x) is x and torch.equal(x, torch.arange(5.0))
    backend.close()


def test_shm_refuses_cuda_device() -> None:
    with pytest.raises(BackendUnavailable, match="needs device cpu"):
        comm_backends.create("shm", None, torch.device("cuda"))
    assert "shm" in comm_backends.available(torch.device("cpu"), 2)


def _map_in_child(ref: SegmentRef, script: str) -> subprocess.CompletedProcess:
    code = ("from comm_backends.shm_segment import SegmentRef, map_segment\n"
            f"ref = SegmentRef({ref.pid}, {ref.fd}, {ref.inode}, {ref.size})\n" + script)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=60)


def test_segment_is_private_nameless_and_checked_on_open() -> None:
    before = set(os.listdir("/dev/shm"))
    fd, ref = create_segment(8192, "tpserve-test")
    try:
        st = os.fstat(fd)
        assert st.st_mode & 0o777 == 0o600 and st.st_size == 8192
        assert set(os.listdir("/dev/shm")) == before  # no name exists, not even briefly
        mine = map_segment(ref)
        mine[:5] = b"hello"
        # Another process of this node reaches it through /proc and shares the memory.
        out = _map_in_child(ref, "m = map_segment(ref); print(bytes(m[:5]).decode()); m[5:6] = b'!'")
        assert out.stdout.strip() == "hello", out.stderr
        assert mine[5:6] == b"!"
        # A descriptor that is not the segment (another inode) is refused, not mapped.
        out = _map_in_child(ref, "import dataclasses\n"
                                 "map_segment(dataclasses.replace(ref, inode=ref.inode + 1))")
        assert "is not the segment" in out.stderr, out.stderr
        mine.close()
    finally:
        os.close(fd)


def test_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPSERVE_SHM_TWO_SHOT_BYTES", "12345")
    monkeypatch.setenv("TPSERVE_SHM_TIMEOUT_S", "2.5")
    monkeypatch.setenv("TPSERVE_SHM_BUFFER_BYTES", str(1 << 20))
    cfg = ShmConfig.from_env()
    assert (cfg.two_shot_bytes, cfg.timeout_s, cfg.half_bytes()) == (12345, 2.5, 1 << 19)
