"""The allreduce strategy interface shared by every backend, and its call statistics.

A backend owns one way of summing a tensor across the ranks of a process group. The model
never calls ``torch.distributed`` directly: every tensor-parallel reduction goes through an
``AllReduce`` so that backends can be A/B-tested (and switched live) without touching models.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed as dist

from comm_backends.topology import Topology


class BackendUnavailable(RuntimeError):
    """Raised when a backend cannot run on this device / world size / build / topology.

    Its message is one line naming the backend and the missing requirement, so start-up can
    print it as is.
    """


def job_min(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The smallest ``value`` over the ranks of ``group`` (a CPU-side MIN), for start-up
    decisions every rank must take alike; ``value`` itself outside a job or alone in it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def one_line(text: object) -> str:
    """A multi-line error message (torch's, NCCL's) squeezed onto one line."""
    return " ".join(str(text).split())


def spans_nodes_reason(name: str, topo: Topology) -> str:
    return (f"allreduce backend '{name}' works within one node, but the job spans {topo.nodes} "
            f"nodes ({topo.world_size} ranks, {topo.local_world_size} per node): use "
            "--allreduce hier (fast local backend within nodes), gloo or nccl")


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
    gathers: int = 0  # all_gather calls, counted in calls/bytes/seconds too
    bytes: int = 0
    seconds: float = 0.0
    waited: float = 0.0
    by_phase: dict[str, list[float]] = field(default_factory=dict)  # [calls, seconds, waited]
    # Sub-timings of composite backends (hier: local reduce, cross-node, local broadcast):
    # part -> [calls, seconds]; only where the backend times its parts.
    parts: dict[str, list[float]] = field(default_factory=dict)
    phase: str = "other"

    def record(self, nbytes: int, seconds: float, waited: float = 0.0, calls: int = 1) -> None:
        """``calls`` allreduces of ``nbytes`` each, ``seconds`` and ``waited`` in all."""
        self.calls += calls
        self.bytes += nbytes * calls
        self.seconds += seconds
        self.waited += waited
        entry = self.by_phase.setdefault(self.phase, [0.0, 0.0, 0.0])
        entry[0] += calls
        entry[1] += seconds
        entry[2] += waited

    def record_part(self, part: str, seconds: float) -> None:
        entry = self.parts.setdefault(part, [0.0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def snapshot(self) -> dict[str, object]:
        snap: dict[str, object] = {
            "calls": self.calls,
            "gathers": self.gathers,
            "bytes": self.bytes,
            "seconds": self.seconds,
            "waited_seconds": self.waited,
            "by_phase": {k: {"calls": int(v[0]), "seconds": v[1], "waited_seconds": v[2]}
                         for k, v in self.by_phase.items()},
        }
        if self.parts:
            snap["parts"] = {k: {"calls": int(v[0]), "seconds": v[1]} for k, v in self.parts.items()}
        return snap

    def reset(self) -> None:
        self.calls, self.gathers, self.bytes, self.seconds, self.waited = 0, 0, 0, 0.0, 0.0
        self.by_phase.clear()
        self.parts.clear()


@dataclass(frozen=True)
class StackExchange:
    """What native code needs to run allreduces of one message shape back to back without
    returning to Python (tpserve's native decoder stack reduces between layer halves): the C
    function ``int32_t fn(const void *plan, char *x, int64_t seq, int64_t timeout_ns,
    const int32_t *pids)`` (0: done), the plans of even and odd calls, the first call's
    sequence number, each call's rounds (call i uses seq + i * rounds), the timeout, an
    int32 array of every rank's pid, and the address of an int64 the caller adds each call's
    nanoseconds to (0: none). Afterwards the caller reports the calls it made
    (``AllReduce.stack_exchanged``) or that it failed midway (``stack_failed``)."""

    fn: int
    plans: tuple[int, int]
    seq: int
    rounds: int
    timeout_ns: int
    pids: int
    clock: int = 0
    # The objects behind the addresses (plans, pid array, clock), alive while the caller runs.
    keep: tuple[object, ...] = field(default=(), compare=False, repr=False)

    def args(self) -> list[int]:
        """The op argument: [fn, even plan, odd plan, seq, rounds, timeout_ns, pids, clock]."""
        return [self.fn, *self.plans, self.seq, self.rounds, self.timeout_ns, self.pids,
                self.clock]


class AllReduce(ABC):
    """Sum a tensor over all ranks of ``group``; every rank gets the bit-identical result."""

    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]]  # device types it runs on, e.g. ("cpu",)
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    capture_safe: ClassVar[bool] = False  # may be called inside CUDA-graph capture
    single_node: ClassVar[bool] = False  # needs every rank of the group on one node

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.stats = CommStats()

    @classmethod
    def environment_refusal(cls, device: torch.device) -> str | None:
        """None when this machine's software and devices allow the backend, else one line why.

        Looks at imports, builds and device presence only; the hardware topology is
        ``topology_refusal``'s.
        """
        if device.type not in cls.devices:
            return f"allreduce backend '{cls.name}' needs device {'/'.join(cls.devices)}, got {device.type}"
        return None

    @classmethod
    def topology_refusal(cls, topo: Topology) -> str | None:
        """None when the measured topology allows this backend, else one line why. Pure."""
        if topo.device not in cls.devices:
            return f"allreduce backend '{cls.name}' needs device {'/'.join(cls.devices)}, got {topo.device}"
        if cls.single_node and topo.nodes > 1:
            return spans_nodes_reason(cls.name, topo)
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
        return self._timed(self._all_reduce, tensor, tensor.nbytes)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's ``tensor`` along the last dim (same shape on every rank).

        Counted in the same statistics as the allreduces (``gathers`` tells them apart).
        """
        if self.world_size == 1:
            return tensor
        self.stats.gathers += 1
        return self._timed(self._all_gather, tensor, tensor.nbytes * self.world_size)

    def _timed(self, op: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor,
               nbytes: int) -> torch.Tensor:
        # On CPU a clock read (~0.1 us) is noise next to any collective, so calls are always
        # timed; on CUDA timing needs a device sync, so only while profiling is enabled.
        if tensor.is_cuda and not self.stats.enabled:
            self.stats.record(nbytes, 0.0)
            return op(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        start, waited = time.perf_counter(), self.waited_seconds()
        out = op(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        self.stats.record(nbytes, time.perf_counter() - start, self.waited_seconds() - waited)
        return out

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """One all-gather through torch.distributed on ``gather_group()``: each rank's bytes
        move once, where an allreduce of a zero-padded buffer moved world x as many, summed."""
        return gather_last_dim(tensor, self.world_size, self.gather_group())

    def gather_group(self) -> dist.ProcessGroup | None:
        """The group ``_all_gather`` uses; it must support this backend's device."""
        return self.group

    def check(self) -> None:
        """Raise if an earlier asynchronous collective failed (cheap; call at sync points)."""
        return None

    def stack_exchange(self, dtype: torch.dtype, shape: torch.Size) -> StackExchange | None:
        """Allreduces of ``shape`` that native code may run itself (None: call ``all_reduce``)."""
        return None

    def stack_exchanged(self, ex: StackExchange, calls: int, nbytes: int) -> None:
        """``calls`` allreduces of ``nbytes`` each ran natively with ``ex``: counted in the
        statistics, with the time the caller added up at ``ex.clock``."""
        raise NotImplementedError

    def stack_failed(self, why: str) -> None:
        """A native caller stopped midway: this rank's sequence is out of step."""
        raise NotImplementedError

    def close(self) -> None:
        """Release backend resources (shared memory, IPC handles). Idempotent."""
        return None

    # ---- collective set-up: a step that fails on one rank fails on every rank
    def _gather_objects(self, mine: Any) -> list[Any]:
        """Every rank's ``mine`` over this backend's group, in rank order."""
        if self.world_size == 1:
            return [mine]
        entries: list[Any] = [None] * self.world_size
        dist.all_gather_object(entries, mine, group=self.group)
        return entries

    def _agree(self, what: str, step: Callable[[], str | None],
               errors: tuple[type[Exception], ...] = (Exception,)) -> None:
        """Run one set-up step on every rank (it returns a problem, or raises one of
        ``errors``); if it failed on any rank, every rank closes and raises
        BackendUnavailable ("allreduce backend 'NAME' failed WHAT: rank R: ..."), so none is
        left waiting in the next collective for a rank that has already raised."""
        try:
            problem = step()
        except errors as exc:
            problem = one_line(exc)
        failed = [f"rank {r}: {p}" for r, p in enumerate(self._gather_objects(problem))
                  if p is not None]
        if failed:
            self._fail(f"allreduce backend '{self.name}' failed {what}: " + "; ".join(failed))

    def _fail(self, message: str) -> NoReturn:
        """Set-up failed on every rank alike: release what this rank holds (collectively) and
        raise the one-line refusal, which a second error while closing must not replace."""
        try:
            self.close()
        except Exception:  # e.g. a sticky CUDA error: the refusal below says more
            pass
        raise BackendUnavailable(message)


def gather_rows(tensor: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather ``tensor`` over ``group``, the pieces concatenated along dim 0 (rank order),
    into one new tensor: the form every backend accepts, with no per-rank pieces to join."""
    x = tensor.contiguous()
    flat = x.new_empty((world * x.shape[0], *x.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, x, group=group)
    return flat


def gather_last_dim(tensor: torch.Tensor, world: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather ``tensor`` over ``group`` and concatenate the pieces along the last dim."""
    flat = gather_rows(tensor, world, group)
    return flat.view(world, *tensor.shape).movedim(0, -2).reshape(
        *tensor.shape[:-1], world * tensor.shape[-1])
