"""The ``symm_mem`` backend: allreduce through ``torch.distributed._symmetric_memory``.

Owns one symmetric buffer per dtype (rendezvoused once at construction, so calls are
capture-safe), staging inputs into it, and choosing between torch's one-shot, two-shot and
NVLS-multicast (``multimem``) kernels. Every CUDA-only import happens inside functions so the
module loads on CPU-only machines.

torch's kernels sum in the input dtype and in the same rank order on every rank (one-shot), or
let one owner reduce each slice (two-shot), so results are bit-identical across ranks. They
take fp32 and bf16 only, so fp16 is staged through the fp32 buffer (exact widening, one
rounding back: twice the bytes, which is why ``auto`` prefers other backends for fp16).

Hardware: every GPU pair needs P2P and native peer atomics (the signal pads spin on
system-scope atomics; over PCIe without them they may never complete), checked from the
measured topology before any set-up. Set-up itself fails as ``BackendUnavailable`` on every
rank at once (ranks agree after each collective step), so start-up reports it in one line.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.distributed as dist

from comm_backends.base import AllReduce, BackendUnavailable, spans_nodes_reason
from comm_backends.topology import Topology

_OPS = ("one_shot_all_reduce_out", "two_shot_all_reduce_", "multimem_one_shot_all_reduce_out",
        "multimem_all_reduce_")
_MiB = 1 << 20
# The dtype each input dtype is staged (and reduced) in.
_STAGED = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16,
           torch.float16: torch.float32}
# What a set-up step (allocation, rendezvous) raises when this machine cannot run the backend:
# refused on every rank; anything else is a bug and propagates.
_SET_UP_ERRORS = (RuntimeError, OSError, ValueError)


@dataclass(frozen=True)
class SymmMemConfig:
    buffer_bytes: int = 8 * _MiB  # per dtype; larger messages go in chunks of this size
    # One-shot below this. Not measured here (no GPU on the machine this was written on); 256 KiB
    # is where one-shot stops winning on 8x H100 NVLink in public reports. Tune with
    # comm_backends.bench and TPSERVE_SYMM_MEM_TWO_SHOT_BYTES.
    two_shot_bytes: int = 256 << 10
    use_multimem: bool = True  # NVLS multicast kernels where the fabric supports them

    @classmethod
    def from_env(cls) -> SymmMemConfig:
        cfg = cls()
        env = os.environ
        if "TPSERVE_SYMM_MEM_BUFFER_BYTES" in env:
            cfg = replace(cfg, buffer_bytes=int(env["TPSERVE_SYMM_MEM_BUFFER_BYTES"]))
        if "TPSERVE_SYMM_MEM_TWO_SHOT_BYTES" in env:
            cfg = replace(cfg, two_shot_bytes=int(env["TPSERVE_SYMM_MEM_TWO_SHOT_BYTES"]))
        if env.get("TPSERVE_SYMM_MEM_MULTIMEM") == "0":
            cfg = replace(cfg, use_multimem=False)
        return cfg


def _missing_support() -> str | None:
    try:
        import torch.distributed._symmetric_memory as symm  # noqa: F401
    except ImportError as exc:
        return f"allreduce backend 'symm_mem' needs torch.distributed._symmetric_memory ({exc})"
    ops = getattr(torch.ops, "symm_mem", None)
    missing = [op for op in _OPS[:2] if ops is None or not hasattr(ops, op)]
    if missing:
        return f"allreduce backend 'symm_mem': this torch build lacks torch.ops.symm_mem.{missing[0]}"
    return None


class SymmMemAllReduce(AllReduce):
    """Stage into a symmetric buffer, then one of torch's symmetric-memory allreduce kernels."""

    name: ClassVar[str] = "symm_mem"
    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    capture_safe: ClassVar[bool] = True
    single_node: ClassVar[bool] = True

    @classmethod
    def environment_refusal(cls, device: torch.device) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return "allreduce backend 'symm_mem' needs CUDA"
        return _missing_support()

    @classmethod
    def topology_refusal(cls, topo: Topology) -> str | None:
        if topo.device != "cuda":
            return "allreduce backend 'symm_mem' needs CUDA"
        # One NVLink domain across nodes (multi-node NVLink) is still one symmetric-memory domain.
        if topo.nodes > 1 and not topo.multinode_nvlink:
            return spans_nodes_reason(cls.name, topo)
        if topo.capability is not None and topo.capability < (8, 0):
            return "allreduce backend 'symm_mem' needs compute capability 8.0 or newer"
        pair = topo.missing_pair(topo.p2p)
        if pair is not None:
            return f"allreduce backend 'symm_mem': P2P not available between GPU {pair[0]} and {pair[1]}"
        pair = topo.missing_pair(topo.atomics)
        if pair is not None:
            return (f"allreduce backend 'symm_mem': no native peer atomics between GPU {pair[0]} "
                    f"and {pair[1]} (PCIe?): its signal pads could hang")
        return None

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, config: SymmMemConfig | None = None
    ) -> None:
        super().__init__(group, device)
        self.config = config if config is not None else SymmMemConfig.from_env()
        if self.config.buffer_bytes < 16 or self.config.buffer_bytes % 16:
            # Chunks must stay whole 16-byte vectors: torch's kernels check the size alignment.
            raise BackendUnavailable("allreduce backend 'symm_mem': buffer_bytes must be a positive "
                                     f"multiple of 16, got {self.config.buffer_bytes}")
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._multimem = False
        self._group_name = ""
        if dist.is_initialized():  # also at world 1, so a one-GPU machine can exercise the kernels
            group = self.group if self.group is not None else dist.group.WORLD
            self._group_name = group.group_name
            self._agree("to set up", self._allocate, _SET_UP_ERRORS)
            self._agree("to set up", self._rendezvous, _SET_UP_ERRORS)
            # The multimem and plain kernels use the signal pads differently: every rank must
            # pick the same ones, so multicast is used only where every rank has it.
            self._multimem = all(flag is True for flag in self._gather_objects(self._multimem))

    def _allocate(self) -> None:
        import torch.distributed._symmetric_memory as symm

        enabled = getattr(symm, "is_symm_mem_enabled_for_group", None)
        if enabled is not None and not enabled(self._group_name):
            with warnings.catch_warnings():  # needed before torch 2.8, a deprecated no-op after
                warnings.simplefilter("ignore", FutureWarning)
                symm.enable_symm_mem_for_group(self._group_name)
        for dtype in sorted(set(_STAGED.values()), key=str):
            numel = self.config.buffer_bytes // dtype.itemsize
            self._bufs[dtype] = symm.empty(numel, dtype=dtype, device=self.device)
            self._scratch[dtype] = torch.empty(numel, dtype=dtype, device=self.device)

    def _rendezvous(self) -> None:
        import torch.distributed._symmetric_memory as symm

        multicast = True
        for dtype in sorted(self._bufs, key=str):  # the same order on every rank
            handle = symm.rendezvous(self._bufs[dtype], self._group_name)  # once: capture-safe
            multicast &= _multicast(handle)
        ops = torch.ops.symm_mem
        self._multimem = (
            self.config.use_multimem and multicast and all(hasattr(ops, op) for op in _OPS[2:])
        )

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        staged = _STAGED.get(tensor.dtype)
        if staged not in self._bufs:
            raise TypeError(f"symm_mem allreduce supports {self.dtypes}, got {tensor.dtype}")
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = work.view(-1)
        step = self._bufs[staged].numel()
        two_shot = flat.numel() * staged.itemsize >= self.config.two_shot_bytes
        for start in range(0, flat.numel(), step):
            self._reduce_chunk(flat[start : start + step], two_shot)
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def _reduce_chunk(self, chunk: torch.Tensor, two_shot: bool) -> None:
        ops, name = torch.ops.symm_mem, self._group_name
        n, kind = chunk.numel(), _STAGED[chunk.dtype]
        # torch's kernels need 4-byte-aligned sizes and vectorise at 16: pad the staged length;
        # the padding sums stale bytes that are never copied out.
        pad = 16 // kind.itemsize
        m = -(-n // pad) * pad
        staged = self._bufs[kind][:m]
        staged[:n].copy_(chunk)  # widens fp16 to fp32
        if two_shot:
            if self._multimem:
                ops.multimem_all_reduce_(staged, "sum", name)
            else:
                ops.two_shot_all_reduce_(staged, "sum", name)
            chunk.copy_(staged[:n])
            return
        direct = m == n and kind == chunk.dtype and chunk.data_ptr() % 16 == 0
        out = chunk if direct else self._scratch[kind][:m]
        if self._multimem:
            ops.multimem_one_shot_all_reduce_out(staged, "sum", name, out)
        else:
            ops.one_shot_all_reduce_out(staged, "sum", name, out)
        if not direct:
            chunk.copy_(out[:n])

    def close(self) -> None:
        self._bufs.clear()
        self._scratch.clear()


def _multicast(handle: object) -> bool:
    """Whether this rendezvoused buffer has a multicast (NVLS) mapping, which the multimem
    kernels need (they fail with "multicast support is required" without one).

    That is the handle's ``multicast_ptr`` (0 without a mapping). Not
    ``_SymmetricMemory.has_multicast_support(device_type, index)``: that only asks whether the
    *device* could do multicast, and torch skips the group's multicast set-up with a warning
    when creating, importing or binding the multicast object fails (no fabric manager, a
    container without it, one rank unable), so a capable device can hold a buffer without one.
    """
    try:
        return bool(getattr(handle, "multicast_ptr", 0))
    except RuntimeError:
        return False
