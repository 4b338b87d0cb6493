"""CUDA allreduce backends (nccl, cuda_p2p, symm_mem): clean refusal without CUDA; on GPUs,
correctness, bit-identity across ranks, all-gather and CUDA-graph replay at every GPU count.

A backend the topology or environment refuses is a visible skip with its reason, never a
pass; with ``REQUIRE=cuda_p2p,symm_mem,...`` a skip of a listed backend is a failure. A backend
that is not refused is built directly, so any set-up error (a RuntimeError, a failed
self-test) fails the test instead of hiding as a refusal. On a CPU-only machine only the
refusal tests run.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import numpy
import pytest
import torch
import torch.distributed as dist

import comm_backends
from comm_backends.base import AllReduce, BackendUnavailable
from comm_backends.topology import Placement
from tests.test_comm_shm import _assert_same_everywhere, _check_case, run_world

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
GPUS = torch.cuda.device_count() if HAS_CUDA else 0
REQUIRED = frozenset(n.strip() for n in os.environ.get("REQUIRE", "").split(",") if n.strip())
WORLDS = list(range(2, max(GPUS, 2) + 1))  # every GPU count this machine has, no cap
NAMES = ("nccl", "cuda_p2p", "symm_mem")
SIZES = ((1,), (7,), (8,), (4095,), (4096,), (3, 1001), (131_073,), (1_000_000,))
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def refused(name: str, reason: str) -> NoReturn:
    """A backend that cannot run here: a failure if required, else a skip that says why."""
    if name in REQUIRED:
        pytest.fail(f"{name} is required (REQUIRE) but refused: {reason}")
    pytest.skip(f"{name} refused: {reason}")


def build_or_refuse(name: str, world: int = 1, **kwargs: Any) -> AllReduce:
    """The backend on GPU 0 at world 1; a refusal skips (or fails if required)."""
    topo = comm_backends.measure(torch.device("cuda", 0), Placement(0, world, 0, world, 0))
    reason = comm_backends.refusal(name, topo)
    if reason is not None:
        refused(name, reason)
    return comm_backends.backend_class(name)(None, torch.device("cuda", 0), **kwargs)


# ---------------------------------------------------------------------------- any machine
@pytest.mark.parametrize("module", ["comm_backends.cuda_p2p", "comm_backends.symm_mem"])
def test_cuda_modules_import_without_cupy_or_cuda(module: str) -> None:
    had_cupy = "cupy" in sys.modules
    importlib.import_module(module)
    assert ("cupy" in sys.modules) == had_cupy  # cupy is only imported when a backend is built


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_backends_refuse_cleanly_without_cuda(name: str, device: str) -> None:
    with pytest.raises(BackendUnavailable) as info:
        comm_backends.create(name, None, torch.device(device))
    message = str(info.value)
    assert name in message and "\n" not in message
    assert name not in comm_backends.available(torch.device(device), 2)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
def test_refusal_reasons_say_what_is_missing() -> None:
    cuda = torch.device("cuda")
    for name in NAMES:
        assert comm_backends.unavailable_reason(name, cuda, 2).endswith("needs CUDA")
    with pytest.raises(BackendUnavailable, match="no allreduce backend for cuda"):
        comm_backends.resolve_auto(cuda, 2)


def test_cuda_p2p_allocates_whole_ipc_blocks() -> None:
    """cudaMalloc may sub-allocate a small request from a larger block; CUDA IPC shares (and
    a peer opens, from its start) the whole block, so only 2 MiB multiples map at offset 0."""
    from comm_backends.cuda_p2p import IPC_GRANULARITY, ipc_alloc_bytes
    from comm_backends.cuda_p2p_kernels import SIGNAL_BYTES

    assert IPC_GRANULARITY == 2 << 20
    for buffer_bytes in (16, 64 << 10, (2 << 20) - SIGNAL_BYTES, 2 << 20, 8 << 20, 100 << 20):
        size = ipc_alloc_bytes(buffer_bytes)
        assert size % IPC_GRANULARITY == 0 and size >= SIGNAL_BYTES + buffer_bytes
        assert size - IPC_GRANULARITY < SIGNAL_BYTES + buffer_bytes  # no more than needed
    assert ipc_alloc_bytes((2 << 20) - SIGNAL_BYTES) == 2 << 20


def _scenario_setup_step_fails_on_one_rank(rank: int, world: int) -> str:
    """cuda_p2p's set-up agreement without a GPU: the last rank's step fails, the others'
    succeed; every rank must raise the same one-line error instead of waiting for it."""
    from comm_backends.cuda_p2p import CudaP2PAllReduce

    backend = object.__new__(CudaP2PAllReduce)
    AllReduce.__init__(backend, None, torch.device("cpu"))
    # No device (-1: torch.cuda.device is a no-op) and nothing mapped: close() only meets.
    backend._dev, backend._closed, backend._base, backend._peers, backend._views = -1, False, 0, [], {}

    def step() -> None:
        if rank == world - 1:
            raise RuntimeError("cudaErrorMapBufferObjectFailed:\nmapping of buffer object failed")

    try:
        backend._agree("to set up (opening the peers' buffers)", step)
    except BackendUnavailable as exc:
        assert backend._closed
        backend.close()  # idempotent: no second barrier that the peers would not meet
        dist.barrier()  # and the group still pairs up afterwards
        return str(exc)
    return "no error"


def test_cuda_p2p_set_up_failure_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    world = 2
    messages = run_world(world, _scenario_setup_step_fails_on_one_rank, tmp_path)
    for rank in range(world):
        message = messages[rank]
        assert message.startswith("allreduce backend 'cuda_p2p' failed to set up"), message
        assert f"rank {world - 1}: cudaErrorMapBufferObjectFailed: mapping" in message
        assert "\n" not in message


@pytest.mark.skipif(not HAS_CUDA or HAS_CUPY, reason="checks the no-cupy refusal on a GPU machine")
def test_cuda_p2p_names_the_missing_cupy() -> None:
    reason = comm_backends.unavailable_reason("cuda_p2p", torch.device("cuda", 0), 1)
    assert reason is not None and "pip install tpserve[gpu]" in reason
    if "cuda_p2p" in REQUIRED:
        pytest.fail(f"cuda_p2p is required (REQUIRE) but refused: {reason}")


@pytest.mark.parametrize(("nvrtc", "capability", "refuses"), [
    (13, (7, 0), True), (13, (7, 2), True), (13, (7, 5), False), (12, (7, 0), False),
    (13, (9, 0), False)])
def test_cuda_p2p_refuses_volta_with_cuda_13s_nvrtc(nvrtc: int, capability: tuple[int, int],
                                                    refuses: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA 13's NVRTC cannot compile for compute capability 7.0 / 7.2: a refusal up front
    (``auto`` then takes another backend), not a failed compile at set-up."""
    from types import SimpleNamespace

    from comm_backends.cuda_p2p import CudaP2PAllReduce

    fake = SimpleNamespace(cuda=SimpleNamespace(nvrtc=SimpleNamespace(getVersion=lambda: (nvrtc, 0))))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = CudaP2PAllReduce.environment_refusal(torch.device("cuda", 0))
    if refuses:
        assert reason is not None and "cupy-cuda12x" in reason
        assert f"{capability[0]}.{capability[1]}" in reason
    else:
        assert reason is None


# ---------------------------------------------------------------------------- one GPU
def _reduce_world_of_one(backend: AllReduce, x: torch.Tensor) -> torch.Tensor:
    # AllReduce.all_reduce short-cuts a world of one; call the kernel path itself.
    return backend._all_reduce(x)


@needs_cuda
@pytest.mark.parametrize("two_shot", [False, True])
def test_cuda_p2p_world_of_one_is_exact(two_shot: bool) -> None:
    from comm_backends.cuda_p2p import CudaP2PConfig

    config = CudaP2PConfig(buffer_bytes=64 << 10, two_shot_bytes=0 if two_shot else 1 << 40)
    backend = build_or_refuse("cuda_p2p", config=config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in SIZES:
            x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
            assert torch.equal(_reduce_world_of_one(backend, x.clone()), x), (dtype, shape)
        odd = torch.randn(1001, device="cuda").to(dtype)[1:]  # not 16-byte aligned: staged out
        assert torch.equal(_reduce_world_of_one(backend, odd.clone()), odd)
    backend.close()


@needs_cuda
def test_cuda_p2p_replays_inside_a_cuda_graph() -> None:
    backend = build_or_refuse("cuda_p2p")
    assert backend.capture_safe
    static = torch.zeros(4096, device="cuda", dtype=torch.bfloat16)
    _reduce_world_of_one(backend, static)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _reduce_world_of_one(backend, static)
    for step in range(3):
        value = torch.randn(4096, device="cuda").to(torch.bfloat16)
        static.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, value), step
    backend.close()


@needs_cuda
def test_cuda_p2p_gives_up_on_a_silent_peer_and_says_so() -> None:
    """A "rank 1" that never arrives: the kernel stops after its limit, raises the flag, and
    every later kernel on this rank returns at once instead of waiting again."""
    from comm_backends.cuda_p2p_flag import CollectiveTimeout
    from comm_backends.cuda_p2p_kernels import MAX_RANKS, SIGNAL_BYTES, THREADS

    backend = build_or_refuse("cuda_p2p")
    import cupy

    ghost = cupy.zeros(SIGNAL_BYTES + (64 << 10), dtype=cupy.uint8)  # nobody runs rank 1
    own, other, pad = backend._base, ghost.data.ptr, [0] * (MAX_RANKS - 2)
    table = cupy.asarray(numpy.array([own + SIGNAL_BYTES, other + SIGNAL_BYTES, *pad, own, other,
                                      *pad, backend._host_error.data_ptr()], dtype=numpy.uint64))
    out = torch.zeros(1024, device="cuda")

    def launch(limit_ns: int) -> float:
        start = time.monotonic()
        backend._kernels["one_shot<F32>"]((1,), (THREADS,), (
            table, numpy.uint64(out.data_ptr()), numpy.uint64(1024), numpy.int32(0),
            numpy.int32(2), numpy.uint64(limit_ns)))
        torch.cuda.synchronize()
        return time.monotonic() - start

    took = launch(300_000_000)
    assert 0.3 <= took < 10, took
    with pytest.raises(CollectiveTimeout, match=r"for rank 1 \(start of a call, block 0\)"):
        backend.check()
    with pytest.raises(CollectiveTimeout):
        _reduce_world_of_one(backend, torch.ones(8, device="cuda"))  # refuses at once
    assert launch(5_000_000_000) < 1.0  # sticky on the device too: no second wait
    backend.close()


def _scenario_symm_mem_world_of_one(rank: int, world: int) -> str:
    from comm_backends.symm_mem import SymmMemConfig

    torch.cuda.set_device(0)
    for two_shot in (1 << 40, 0):
        backend = comm_backends.backend_class("symm_mem")(
            None, torch.device("cuda", 0), SymmMemConfig(two_shot_bytes=two_shot))
        for dtype in backend.dtypes:  # fp16 included: staged through fp32
            for shape in SIZES:
                x = torch.randn(shape, device="cuda").to(dtype)
                assert torch.equal(_reduce_world_of_one(backend, x.clone()), x), (dtype, shape)
        backend.close()
    return "ok"


@needs_cuda
def test_symm_mem_world_of_one_in_a_group(tmp_path: Path) -> None:
    topo = comm_backends.measure(torch.device("cuda", 0), Placement(0, 1, 0, 1, 0))
    reason = comm_backends.refusal("symm_mem", topo)
    if reason is not None:
        refused("symm_mem", reason)
    assert run_world(1, _scenario_symm_mem_world_of_one, tmp_path)[0] == "ok"


# ---------------------------------------------------------------------------- many GPUs
class _GpuProxy:
    """Looks like a CPU AllReduce to ``_check_case``; runs ``backend`` on the GPU."""

    def __init__(self, backend: AllReduce) -> None:
        self.backend, self.name = backend, backend.name
        self.world_size, self.rank = backend.world_size, backend.rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.backend.all_reduce(tensor.to(self.backend.device)).cpu()


def _check_graph(backend: AllReduce) -> None:
    """Capture one allreduce, replay it on new data: the result must follow the data."""
    static = torch.full((8192,), float(backend.rank + 1), device=backend.device)
    backend.all_reduce(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.all_reduce(static)
    expected = float(sum(range(1, backend.world_size + 1)))
    for _ in range(3):
        static.fill_(float(backend.rank + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert bool((static == expected).all()), backend.name


def _check_gather(backend: AllReduce) -> None:
    mine = torch.full((4, 33), float(backend.rank), device=backend.device)
    out = backend.all_gather(mine).cpu()
    expected = torch.cat([torch.full((4, 33), float(r)) for r in range(backend.world_size)], -1)
    assert torch.equal(out, expected), backend.name


def _scenario_cuda(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    nccl_group = dist.new_group(backend="nccl")  # the default group here is gloo
    topo = comm_backends.measure(device, Placement(rank, world, rank, world, 0))
    report: dict[str, Any] = {}
    for name in NAMES:
        reason = comm_backends.refusal(name, topo)
        if reason is not None:
            report[name] = ("refused", reason)
            continue
        backend = comm_backends.backend_class(name)(nccl_group, device)  # set-up errors fail
        proxy = _GpuProxy(backend)
        digests = [_check_case(proxy, shape, dtype, 100 * i + 7)
                   for i, shape in enumerate(SIZES) for dtype in backend.dtypes]
        _assert_same_everywhere(digests)
        _check_graph(backend)
        _check_gather(backend)
        backend.check()
        dist.barrier()
        backend.close()
        report[name] = ("ok", len(digests))
    return report


@pytest.fixture(scope="module")
def world_results(tmp_path_factory: pytest.TempPathFactory) -> Any:
    @cache
    def results(world: int) -> dict[str, Any]:
        return run_world(world, _scenario_cuda, tmp_path_factory.mktemp(f"world{world}"))[0]

    return results


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world", WORLDS)
def test_cuda_backends_match_reference_across_gpus(world: int, name: str, world_results: Any) -> None:
    if GPUS < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {GPUS}")
    status, detail = world_results(world)[name]
    if status == "refused":
        refused(name, detail)
    assert status == "ok" and detail > 0
