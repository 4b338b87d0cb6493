"""Process groups, rank/device selection, and the switchable allreduce used by the model.

A node is a torchrun agent (``GROUP_RANK``), so ranks know the node boundary even when two
"nodes" share a machine; ``create_comm`` measures the topology on every rank, takes the union
of what any rank refuses, and resolves ``auto`` identically everywhere, logging its reason once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import comm_backends
from comm_backends import AllReduce, BackendUnavailable, Topology
from comm_backends.base import StackExchange
from comm_backends.topology import Placement
from tpserve.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    node_rank: int = 0  # torchrun's GROUP_RANK

    @property
    def placement(self) -> Placement:
        return Placement(self.rank, self.world_size, self.local_rank, self.local_world_size,
                         self.node_rank)

    @property
    def nodes(self) -> int:
        return self.placement.nodes


def rank_info(device_flag: str) -> RankInfo:
    """Rank/world/node from torchrun's environment (TP=1 without it) and the device to use."""
    where = Placement.from_env()
    kind = device_flag if device_flag != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda requested but CUDA is not available", flag="--device")
    if kind == "cuda" and where.local_rank >= torch.cuda.device_count():
        # Local rank i serves GPU i: more ranks than GPUs on a node would otherwise die in
        # set_device with a bare "invalid device ordinal".
        raise ConfigError(f"local rank {where.local_rank} has no GPU of its own: "
                          f"{torch.cuda.device_count()} visible on this node; launch at most "
                          "that many ranks per node (--nproc-per-node)", flag="--device")
    device = torch.device(f"cuda:{where.local_rank}") if kind == "cuda" else torch.device("cpu")
    return RankInfo(where.rank, where.world_size, where.local_rank, where.local_world_size,
                    device, where.node_rank)


def cpu_threads_per_rank(local_world: int, override: int | None, cores: int | None = None) -> int:
    """Split the cores between the ranks of this host so they do not oversubscribe.

    Each rank gets its whole share, the HTTP core included at TP = 1: the event loop needs
    little, and gemm.c's pool and torch's threads then stream weights on every core. Served,
    TP = 1 on the 2-vCPU Xeon, the 80 MB bench model (launch.bench_served --figures b1,b16,
    three interleaved rounds, medians): one thread 79 / 475 tok/s at 1 / 16 streams, two
    threads 144 / 616. (Leaving a core to HTTP was right for ATen's spinning OpenMP threads on
    the tiny demo model; it no longer is.)
    """
    if override:
        return override
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, local_world))


def init_process_group(info: RankInfo, timeout_s: float) -> None:
    if info.world_size == 1 or dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if info.device.type == "cuda" else "gloo"
    extra: dict[str, Any] = {}
    if info.device.type == "cuda":
        # Bind this rank to its GPU before anything touches CUDA, and give NCCL the device:
        # the communicator is then created now, on this GPU (not guessed from the rank, not
        # lazily at the first NCCL op: with cuda_p2p / symm_mem active that is the head's
        # all-gather, after the KV cache was sized from the free memory).
        torch.cuda.set_device(info.device)
        extra["device_id"] = info.device
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **extra)


# Opaque to torch.compile (--compile at TP > 1): a collective is a graph break, and dynamo must
# not trace into the backends: it guarded on their call counters and clock reads, recompiled
# at every call until its limit, and the served demo pair fell from ~430 to ~77 tok/s at batch
# 1. (At TP = 1 the callers above return before reaching it, so fullgraph still holds.)
@torch.compiler.disable
def _collective(op: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    return op(tensor)


class CommSwitch:
    """Every backend requested at launch, with one active; the model reduces through this.

    Switching is only done between steps, on every rank at once (driven by the step plan),
    so all ranks always use the same backend for the same collective.
    """

    def __init__(self, backends: dict[str, AllReduce], active: str) -> None:
        self.backends = backends
        self.active_name = active
        self.active = backends[active]

    def set_active(self, name: str) -> None:
        if name not in self.backends:
            raise ValueError(f"allreduce backend '{name}' was not initialised at launch "
                             f"(initialised: {', '.join(self.backends)})")
        self.active_name, self.active = name, self.backends[name]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.active.world_size == 1 else _collective(self.active.all_reduce, tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.active.world_size == 1 else _collective(self.active.all_gather, tensor)

    def stack_exchange(self, dtype: torch.dtype, shape: torch.Size) -> StackExchange | None:
        """The active backend's native allreduces of ``shape`` (``AllReduce.stack_exchange``)."""
        active = self.active
        return None if active.world_size == 1 else active.stack_exchange(dtype, shape)

    def stack_exchanged(self, ex: StackExchange, calls: int, nbytes: int) -> None:
        self.active.stack_exchanged(ex, calls, nbytes)

    def stack_failed(self, why: str) -> None:
        self.active.stack_failed(why)

    def set_phase(self, phase: str) -> None:
        for backend in self.backends.values():
            backend.stats.phase = phase

    def set_profiling(self, enabled: bool) -> None:
        for backend in self.backends.values():
            backend.stats.enabled = enabled

    def stats(self) -> dict[str, object]:
        return {name: b.stats.snapshot() for name, b in self.backends.items()}

    def check(self) -> None:
        """Raise if a backend's asynchronous collective failed (e.g. a cuda_p2p kernel gave up
        waiting for a peer). Costs a memory read per backend: call once per step."""
        for backend in self.backends.values():
            backend.check()

    def reset_stats(self) -> None:
        for backend in self.backends.values():
            backend.stats.reset()

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


def parse_backend_list(flag: str) -> list[str]:
    names = [n.strip() for n in flag.split(",") if n.strip()]
    if not names:
        raise ValueError("--allreduce needs at least one backend name")
    return names


def agreed_view(info: RankInfo, dtype: torch.dtype | None) -> tuple[Topology, dict[str, str]]:
    """Rank 0's topology and every backend refused on *any* rank: the same on every rank."""
    return comm_backends.agree_on(comm_backends.measure(info.device, info.placement, dtype))


def create_comm(flag: str, info: RankInfo, dtype: torch.dtype | None = None) -> CommSwitch:
    """Initialise every backend named in ``flag`` (comma list, first active).

    ``dtype`` (the model's, when known) lets ``auto`` weigh what each backend does with it.
    A backend that cannot run, or fails to set up, is a ConfigError naming ``--allreduce``.
    """
    names = parse_backend_list(flag)
    topo, refused = agreed_view(info, dtype)
    try:
        if "auto" in names:
            choice = comm_backends.choose(topo, refused)
            if info.rank == 0:
                log.info("allreduce auto -> %s: %s", choice.name, choice.reason)
            names = [choice.name if n == "auto" else n for n in names]
        backends: dict[str, AllReduce] = {}
        for name in names:
            if name in refused:
                raise BackendUnavailable(refused[name])
            if name not in backends:
                backends[name] = comm_backends.create(name, None, info.device, topo)
    except BackendUnavailable as exc:
        raise ConfigError(str(exc), flag="--allreduce") from None
    return CommSwitch(backends, names[0])
