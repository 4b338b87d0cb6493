"""CUDA allreduce backends (cuda_p2p, symm_mem, nccl): clean refusal without CUDA, and on GPUs
correctness, bit-identity across ranks and CUDA-graph capture.

On a CPU-only machine only the refusal tests run; the rest skip with a reason. One GPU is
enough for the world-of-one kernel checks; the multi-rank checks need two or more.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm_backends
from comm_backends.base import AllReduce, BackendUnavailable
from tests.test_comm_shm import _assert_same_everywhere, _check_case, run_world

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
GPUS = torch.cuda.device_count() if HAS_CUDA else 0
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
needs_cupy = pytest.mark.skipif(not (HAS_CUDA and HAS_CUPY), reason="needs a CUDA GPU and cupy")
needs_2_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two or more CUDA GPUs")
SIZES = ((1,), (7,), (8,), (4095,), (4096,), (3, 1001), (131_073,), (1_000_000,))


# ---------------------------------------------------------------------------- any machine
@pytest.mark.parametrize("module", ["comm_backends.cuda_p2p", "comm_backends.symm_mem"])
def test_cuda_modules_import_without_cupy_or_cuda(module: str) -> None:
    had_cupy = "cupy" in sys.modules
    importlib.import_module(module)
    assert ("cupy" in sys.modules) == had_cupy  # cupy is only imported when a backend is built


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only refusal")
@pytest.mark.parametrize("name", ["cuda_p2p", "symm_mem", "nccl"])
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
    for name in ("cuda_p2p", "symm_mem"):
        assert comm_backends.unavailable_reason(name, cuda, 2).endswith("needs CUDA")
    with pytest.raises(BackendUnavailable, match="no allreduce backend available for cuda"):
        comm_backends.resolve_auto(cuda, 2)


@pytest.mark.skipif(not HAS_CUDA or HAS_CUPY, reason="checks the no-cupy refusal on a GPU machine")
def test_cuda_p2p_names_the_missing_cupy() -> None:
    reason = comm_backends.unavailable_reason("cuda_p2p", torch.device("cuda", 0), 1)
    assert reason is not None and "pip install tpserve[gpu]" in reason


# ---------------------------------------------------------------------------- one GPU
def _reduce_world_of_one(backend: AllReduce, x: torch.Tensor) -> torch.Tensor:
    # AllReduce.all_reduce short-cuts a world of one; call the kernel path itself.
    return backend._all_reduce(x)


@needs_cupy
@pytest.mark.parametrize("two_shot", [False, True])
def test_cuda_p2p_world_of_one_is_exact(two_shot: bool) -> None:
    from comm_backends.cuda_p2p import CudaP2PAllReduce, CudaP2PConfig

    cfg = CudaP2PConfig(buffer_bytes=64 << 10, two_shot_bytes=0 if two_shot else 1 << 40)
    backend = CudaP2PAllReduce(None, torch.device("cuda", 0), cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in SIZES:
            x = torch.randn(shape, generator=gen, device="cuda").to(dtype)
            assert torch.equal(_reduce_world_of_one(backend, x.clone()), x)
        odd = torch.randn(1001, device="cuda").to(dtype)[1:]  # not 16-byte aligned: staged out
        assert torch.equal(_reduce_world_of_one(backend, odd.clone()), odd)
    backend.close()


@needs_cupy
def test_cuda_p2p_replays_inside_a_cuda_graph() -> None:
    from comm_backends.cuda_p2p import CudaP2PAllReduce

    backend = CudaP2PAllReduce(None, torch.device("cuda", 0))
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


def _scenario_symm_mem_world_of_one(rank: int, world: int) -> str:
    from comm_backends.symm_mem import SymmMemAllReduce, SymmMemConfig

    torch.cuda.set_device(0)
    try:
        backends = [SymmMemAllReduce(None, torch.device("cuda", 0), SymmMemConfig(two_shot_bytes=t))
                    for t in (1 << 40, 0)]
    except (BackendUnavailable, RuntimeError) as exc:
        return f"cannot set up: {exc}"
    for backend in backends:
        for dtype in backend.dtypes:
            for shape in SIZES:
                x = torch.randn(shape, device="cuda").to(dtype)
                assert torch.equal(_reduce_world_of_one(backend, x.clone()), x), (dtype, shape)
        backend.close()
    return "ok"


@needs_cuda
def test_symm_mem_world_of_one_is_exact(tmp_path: Path) -> None:
    if comm_backends.unavailable_reason("symm_mem", torch.device("cuda", 0), 1):
        pytest.skip(comm_backends.unavailable_reason("symm_mem", torch.device("cuda", 0), 1))
    outcome = run_world(1, _scenario_symm_mem_world_of_one, tmp_path)[0]
    if outcome != "ok":
        pytest.skip(f"torch symmetric memory on one rank: {outcome}")


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


def _scenario_cuda(rank: int, world: int, names: tuple[str, ...]) -> dict[str, Any]:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    nccl_group = dist.new_group(backend="nccl")  # the default group here is gloo
    report: dict[str, Any] = {}
    for name in names:
        try:
            backend = comm_backends.create(name, nccl_group if name == "nccl" else None, device)
        except BackendUnavailable as exc:
            report[name] = f"unavailable: {exc}"
            continue
        proxy = _GpuProxy(backend)
        digests = [_check_case(proxy, shape, dtype, 100 * i + 7)
                   for i, shape in enumerate(SIZES) for dtype in backend.dtypes]
        _assert_same_everywhere(digests)
        _check_graph(backend)
        dist.barrier()
        backend.close()
        report[name] = len(digests)
    return report


@needs_2_gpus
def test_cuda_backends_match_reference_across_gpus(tmp_path: Path) -> None:
    world = min(GPUS, 4)
    results = run_world(world, _scenario_cuda, tmp_path, names=("nccl", "cuda_p2p", "symm_mem"))
    assert isinstance(results[0]["nccl"], int), results[0]["nccl"]
    for name in ("cuda_p2p", "symm_mem"):
        outcome = results[0][name]
        # Either it ran every case, or it refused for a stated missing requirement.
        assert isinstance(outcome, int) or "needs" in outcome or "P2P not available" in outcome, outcome
