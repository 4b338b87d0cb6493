"""The allreduce strategy interface shared by every backend, and its call statistics.

A backend owns one way of summing a tensor across the ranks of a process group. The model
never calls ``torch.distributed`` directly: every tensor-parallel reduction goes through an
``AllReduce`` so that backends can be A/B-tested (and switched live) without touching models.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist


class BackendUnavailable(RuntimeError):
    """Raised when a backend cannot run on this device / world size / build."""


@dataclass
class CommStats:
    """Per-backend call statistics, split by the phase the engine is in (draft, verify, ...).

    Counting is always on (far cheaper than any allreduce); on CUDA, timing needs a device
    sync per call, so there it is only collected while ``enabled`` (profiling).

    ``waited`` is the part of ``seconds`` spent waiting for late peers, where the backend can
    tell (``shm``; 0 elsewhere): allreduce time that a faster transport would not remove.
    """

    enabled: bool = False
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    waited: float = 0.0
    by_phase: dict[str, list[float]] = field(default_factory=dict)  # [calls, seconds, waited]
    phase: str = "other"

    def record(self, nbytes: int, seconds: float, waited: float = 0.0) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.seconds += seconds
        self.waited += waited
        entry = self.by_phase.setdefault(self.phase, [0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        entry[2] += waited

    def snapshot(self) -> dict[str, object]:
        return {
            "calls": self.calls,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "waited_seconds": self.waited,
            "by_phase": {k: {"calls": int(v[0]), "seconds": v[1], "waited_seconds": v[2]}
                         for k, v in self.by_phase.items()},
        }

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds, self.waited = 0, 0, 0.0, 0.0
        self.by_phase.clear()


class AllReduce(ABC):
    """Sum a tensor over all ranks of ``group``; every rank gets the bit-identical result."""

    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]]  # device types it runs on, e.g. ("cpu",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    capture_safe: ClassVar[bool] = False  # may be called inside CUDA-graph capture

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.stats = CommStats()

    @classmethod
    def unavailable_reason(cls, device: torch.device, world_size: int) -> str | None:
        """None when this backend can run here, else one line saying why not."""
        if device.type not in cls.devices:
            return f"allreduce backend '{cls.name}' needs device {'/'.join(cls.devices)}, got {device.type}"
        return None

    def supports(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type in self.devices and tensor.dtype in self.dtypes

    max_bytes: ClassVar[int | None] = None  # largest message, None = unbounded

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Backend-specific sum; may work in place and return ``tensor``."""

    def waited_seconds(self) -> float:
        """Seconds spent so far waiting for late peers (0 where the backend cannot tell)."""
        return 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        nbytes = tensor.nbytes
        # On CPU a clock read (~0.1 us) is noise next to any allreduce, so calls are always
        # timed; on CUDA timing needs a device sync, so only while profiling is enabled.
        if tensor.is_cuda and not self.stats.enabled:
            self.stats.record(nbytes, 0.0)
            return self._all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        start, waited = time.perf_counter(), self.waited_seconds()
        out = self._all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        self.stats.record(nbytes, time.perf_counter() - start, self.waited_seconds() - waited)
        return out

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's ``tensor`` along the last dim (same shape on every rank).

        Built from ``all_reduce`` over a zero-padded buffer so every backend gets it for free and
        its cost shows up in the same statistics; exact because x + 0 == x.
        """
        if self.world_size == 1:
            return tensor
        width = tensor.shape[-1]
        full = tensor.new_zeros(*tensor.shape[:-1], width * self.world_size)
        full[..., self.rank * width : (self.rank + 1) * width] = tensor
        return self.all_reduce(full)

    def close(self) -> None:
        """Release backend resources (shared memory, IPC handles). Idempotent."""
        return None
