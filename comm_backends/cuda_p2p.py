"""The ``cuda_p2p`` backend: a custom one-/two-shot allreduce over CUDA-IPC-shared buffers.

Owns the host side: allocating this rank's buffer (cudaMalloc, so its IPC handle covers exactly
it), exchanging IPC handles over the process group, opening peers' buffers, compiling the
kernels in ``cuda_p2p_kernels`` with cupy's NVRTC, staging inputs and launching on torch's
current stream. cupy is imported only inside functions so this module loads anywhere.

Inputs are always copied into the registered buffer first (one device copy), so no per-tensor
registration is needed and CUDA-graph capture works: the copy and the kernel are both captured,
and the kernels keep their call counters in device memory.

Waits are bounded (``CudaP2PConfig.timeout_s``): a kernel that gives up raises its flag
(``cuda_p2p_flag``), every call checks the flag of the calls before it, and ``check()`` reads
it at the engine's sync points. Set-up ends with a short self-test allreduce on every rank, so
P2P that is advertised but does not deliver (IOMMU/ACS) is refused at start-up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy
import torch
import torch.distributed as dist

from comm_backends.base import AllReduce, one_line
from comm_backends.cuda_p2p_flag import raise_if_failed
from comm_backends.cuda_p2p_kernels import (
    KERNELS,
    MAX_BLOCKS,
    MAX_RANKS,
    SIGNAL_BYTES,
    SOURCE,
    THREADS,
)
from comm_backends.topology import Topology, node_key

_KIND = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_MiB = 1 << 20
# cudaMalloc may sub-allocate a request from a larger block, and CUDA IPC then exports (and a
# peer's cudaIpcOpenMemHandle maps, from its start) that whole block, not the request: a
# sub-allocated buffer would be opened at the wrong address. The CUDA Programming Guide's IPC
# section recommends sharing only allocations whose size is a multiple of 2 MiB.
IPC_GRANULARITY = 2 * _MiB


def ipc_alloc_bytes(buffer_bytes: int) -> int:
    """Bytes to cudaMalloc for the signal area plus ``buffer_bytes``: a multiple of 2 MiB, so
    the allocation is a block of its own and its IPC handle maps exactly it, at offset 0."""
    return -(-(SIGNAL_BYTES + buffer_bytes) // IPC_GRANULARITY) * IPC_GRANULARITY


@dataclass(frozen=True)
class CudaP2PConfig:
    buffer_bytes: int = 8 * _MiB  # registered buffer per rank; larger messages go in chunks
    # Not measured (written without a GPU): one-shot reads world x the data over NVLink, two-shot
    # 2x, so two-shot should win from a few hundred KB. Tune with comm_backends.bench.
    two_shot_bytes: int = 512 << 10
    # Longest wait for a peer inside a kernel. Ranks launch each step's collectives within
    # milliseconds of each other; only a dead, stopped or unreachable peer takes seconds.
    timeout_s: float = 30.0
    self_test_timeout_s: float = 5.0  # the set-up self-test's limit: start-up must not hang

    @classmethod
    def from_env(cls) -> CudaP2PConfig:
        cfg, env = cls(), os.environ
        if "TPSERVE_CUDA_P2P_BUFFER_BYTES" in env:
            cfg = replace(cfg, buffer_bytes=int(env["TPSERVE_CUDA_P2P_BUFFER_BYTES"]))
        if "TPSERVE_CUDA_P2P_TWO_SHOT_BYTES" in env:
            cfg = replace(cfg, two_shot_bytes=int(env["TPSERVE_CUDA_P2P_TWO_SHOT_BYTES"]))
        if "TPSERVE_CUDA_P2P_TIMEOUT_S" in env:
            cfg = replace(cfg, timeout_s=float(env["TPSERVE_CUDA_P2P_TIMEOUT_S"]))
        return cfg


def _peer_access_problem(devices: list[int]) -> str | None:
    for i, a in enumerate(devices):
        for b in devices[i + 1 :]:
            if a != b and not (
                torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a)
            ):
                return f"allreduce backend 'cuda_p2p': P2P not available between GPU {a} and {b}"
    return None


def nvrtc_refusal(nvrtc_major: int, capability: tuple[int, int]) -> str | None:
    """CUDA 13's NVRTC no longer compiles for Volta / Xavier (compute capability 7.0 / 7.2),
    so with cupy-cuda13x on such a GPU the kernels cannot be built: refuse up front, so
    ``auto`` takes another backend instead of failing at set-up."""
    if nvrtc_major >= 13 and capability < (7, 5):
        return (f"allreduce backend 'cuda_p2p': NVRTC {nvrtc_major} cannot compile for compute "
                f"capability {capability[0]}.{capability[1]} (CUDA 13 dropped Volta); "
                "pip install cupy-cuda12x instead of cupy-cuda13x")
    return None


class CudaP2PAllReduce(AllReduce):
    """One-shot (small) / two-shot (large) allreduce kernel over NVLink/PCIe P2P."""

    name: ClassVar[str] = "cuda_p2p"
    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    capture_safe: ClassVar[bool] = True
    single_node: ClassVar[bool] = True

    @classmethod
    def environment_refusal(cls, device: torch.device) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return "allreduce backend 'cuda_p2p' needs CUDA"
        try:
            import cupy
        except ImportError:
            return "allreduce backend 'cuda_p2p' needs cupy: pip install tpserve[gpu]"
        try:
            nvrtc = int(cupy.cuda.nvrtc.getVersion()[0])
        except Exception:  # no NVRTC library: the compile at set-up says what is missing
            return None
        return nvrtc_refusal(nvrtc, torch.cuda.get_device_capability(device))

    @classmethod
    def topology_refusal(cls, topo: Topology) -> str | None:
        reason = super().topology_refusal(topo)
        if reason is not None:
            return reason
        if topo.world_size > MAX_RANKS:
            return f"allreduce backend 'cuda_p2p' supports at most {MAX_RANKS} ranks, got {topo.world_size}"
        if topo.gpus_visible < topo.local_world_size:
            return (f"allreduce backend 'cuda_p2p' needs one visible GPU per rank on one host "
                    f"({topo.gpus_visible} visible, {topo.local_world_size} ranks)")
        if topo.capability is not None and topo.capability < (7, 0):
            return "allreduce backend 'cuda_p2p' needs compute capability 7.0+ (acquire/release)"
        # The usual launch maps local rank i to GPU i; the real devices are checked again at setup.
        pair = topo.missing_pair(topo.p2p)
        if pair is not None:
            return f"allreduce backend 'cuda_p2p': P2P not available between GPU {pair[0]} and {pair[1]}"
        return None

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, config: CudaP2PConfig | None = None
    ) -> None:
        super().__init__(group, device)
        self.config = config if config is not None else CudaP2PConfig.from_env()
        if self.config.buffer_bytes % 16:
            raise ValueError("cuda_p2p buffer_bytes must be a multiple of 16")
        self._dev = device.index if device.index is not None else torch.cuda.current_device()
        self._peers: list[int] = []  # IPC-opened peer base pointers, closed in close()
        self._base = 0
        self._closed = False
        self._streams: dict[int, Any] = {}
        self._kernels: dict[str, Any] = {}
        self._views: dict[torch.dtype, torch.Tensor] = {}
        # The host-mapped give-up word (pinned memory: kernels reach it at the same address
        # under unified addressing) and a numpy view of it, read without any CUDA call.
        self._host_error = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        self._error_word = self._host_error.numpy()
        self._timeout_ns = int(self.config.self_test_timeout_s * 1e9)
        with torch.cuda.device(self._dev):
            self._setup()
            self._agree("its set-up self-test", self._self_test)
        self._timeout_ns = int(self.config.timeout_s * 1e9)

    # ----------------------------------------------------------------- setup
    def _setup(self) -> None:
        import cupy

        rt = cupy.cuda.runtime
        # A step that fails on one rank only must fail on all of them: the others would
        # otherwise wait in the next collective (the exchange, the barrier) for a rank that
        # has already raised. So every step's error travels in the next exchange.
        sms, handle, problem = 0, None, None
        try:
            sms = torch.cuda.get_device_properties(self._dev).multi_processor_count
            self._base = rt.malloc(ipc_alloc_bytes(self.config.buffer_bytes))
            rt.memset(self._base, 0, SIGNAL_BYTES)
            rt.deviceSynchronize()
            # One rank opens no peer's memory: no IPC handle, which a runtime without CUDA IPC
            # (a sandboxed machine) would refuse.
            handle = rt.ipcGetMemHandle(self._base) if self.world_size > 1 else None
        except Exception as exc:  # CUDARuntimeError (out of memory, no IPC), ...
            problem = f"rank {self.rank}: {one_line(exc)}"
        found = self._gather_objects((node_key(), (self._dev, sms, handle, problem)))
        entries = [entry for _, entry in found]
        nodes = len({key for key, _ in found})
        failed = [p for _, _, _, p in entries if p is not None]
        if nodes > 1:
            problem = (f"allreduce backend 'cuda_p2p' works within one node, but its ranks span "
                       f"{nodes} nodes")
        elif failed:
            problem = "allreduce backend 'cuda_p2p' failed to set up: " + "; ".join(failed)
        else:
            problem = _peer_access_problem([dev for dev, _, _, _ in entries])
        if problem is not None:
            self._fail(problem)
        # Same grid on every rank (blocks meet their namesakes), and all of it resident at once
        # so no block waits on a peer block that cannot be scheduled.
        self._max_blocks = max(1, min(MAX_BLOCKS, *(n for _, n, _, _ in entries)))
        # CUDARuntimeError (IPC), cupy's CompileException, ...: every rank refuses alike.
        self._agree("to set up (opening the peers' buffers)", lambda: self._map(entries))
        self._barrier()  # every flag area is zeroed before anyone's first kernel writes to it

    def _map(self, entries: list[tuple[int, int, bytes | None, str | None]]) -> None:
        """Open every peer's buffer (IPC), build the kernels' pointer table, compile."""
        import cupy

        rt = cupy.cuda.runtime
        bases = []
        for rank, (_, _, handle, _) in enumerate(entries):
            if rank == self.rank:
                bases.append(self._base)
            else:
                # Opened on this rank's device (current here); the handle maps the peer's
                # whole allocation from its start, which is the peer's base (ipc_alloc_bytes).
                self._peers.append(rt.ipcOpenMemHandle(handle))
                bases.append(self._peers[-1])
        zeros = [0] * (MAX_RANKS - self.world_size)
        table = [b + SIGNAL_BYTES for b in bases] + zeros + bases + zeros
        table.append(self._host_error.data_ptr())
        self._table = cupy.asarray(numpy.array(table, dtype=numpy.uint64))
        self._compile()
        mem = cupy.cuda.UnownedMemory(self._base + SIGNAL_BYTES, self.config.buffer_bytes, self, self._dev)
        raw = cupy.ndarray((self.config.buffer_bytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
        self._mine = torch.from_dlpack(raw)
        rt.deviceSynchronize()

    def _self_test(self) -> str | None:
        """One small allreduce under a short limit (a set-up step every rank runs, ``_agree``):
        refuses P2P that is advertised but does not deliver, before any request depends on it."""
        expected = float(self.world_size * (self.world_size + 1) // 2)
        x = torch.full((4096,), float(self.rank + 1), device=self.device)
        self._all_reduce(x)
        torch.cuda.synchronize(self._dev)
        self.check()
        return None if bool((x == expected).all()) else "got a wrong sum from the self-test allreduce"

    def check(self) -> None:
        raise_if_failed(self._error_word, self.rank, self._timeout_ns / 1e9)

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def _compile(self) -> None:
        import cupy

        module = cupy.RawModule(code=SOURCE, options=("--std=c++14",), name_expressions=KERNELS)
        # Load every kernel now: module loading must not happen inside graph capture.
        self._kernels = {name: module.get_function(name) for name in KERNELS}

    # ----------------------------------------------------------------- calls
    def _stream(self) -> Any:
        import cupy

        handle = torch.cuda.current_stream(self._dev).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = cupy.cuda.ExternalStream(handle, self._dev)
        return stream

    def _staging(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._views.get(dtype)
        if view is None:
            view = self._views[dtype] = self._mine.view(dtype)
        return view

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in _KIND:
            raise TypeError(f"cuda_p2p allreduce supports {tuple(_KIND)}, got {tensor.dtype}")
        self.check()  # an earlier call gave up: refuse rather than return garbage
        # Results are written straight into the caller's memory when it allows 16-byte stores.
        direct = tensor.is_contiguous() and tensor.data_ptr() % 16 == 0
        work = tensor if direct else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if not direct:
            work.copy_(tensor)
        flat = work.view(-1)
        staging = self._staging(tensor.dtype)
        step = staging.numel()
        two_shot = flat.numel() * flat.element_size() >= self.config.two_shot_bytes
        with self._stream():
            for start in range(0, flat.numel(), step):
                chunk = flat[start : start + step]
                staging[: chunk.numel()].copy_(chunk)
                self._launch(chunk, two_shot)
        if not direct:
            tensor.copy_(work)
        return tensor

    def _launch(self, chunk: torch.Tensor, two_shot: bool) -> None:
        n = chunk.numel()
        per_thread = 16 // chunk.element_size()
        packs = -(-n // per_thread)
        if two_shot:
            packs = -(-packs // self.world_size)
        blocks = max(1, min(self._max_blocks, -(-packs // THREADS)))
        kernel = self._kernels[f"{'two_shot' if two_shot else 'one_shot'}<{_KIND[chunk.dtype]}>"]
        args = (self._table, numpy.uint64(chunk.data_ptr()), numpy.uint64(n),
                numpy.int32(self.rank), numpy.int32(self.world_size), numpy.uint64(self._timeout_ns))
        kernel((blocks,), (THREADS,), args)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        """Collective: peers unmap this rank's buffer before anyone frees their own. Every
        rank calls it once (a failed set-up step closes on all ranks together); idempotent.
        The barrier is reached even when unmapping fails, so no peer is left waiting."""
        if self._closed:
            return
        self._closed = True
        error: Exception | None = None
        with torch.cuda.device(self._dev):
            rt = None
            if self._base or self._peers:
                import cupy

                rt = cupy.cuda.runtime
                try:
                    torch.cuda.synchronize(self._dev)
                    for ptr in self._peers:
                        rt.ipcCloseMemHandle(ptr)
                except Exception as exc:  # raised after the barrier
                    error = exc
                self._peers.clear()
            self._views.clear()
            self._mine = None
            try:
                self._barrier()
            except Exception:  # the group is already gone: nobody can map us any more either
                pass
            if rt is not None and self._base:
                rt.free(self._base)
                self._base = 0
        if error is not None:
            raise error
