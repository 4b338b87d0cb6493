"""The measured facts an allreduce backend's choice depends on, and where this rank sits.

Owns ``Topology`` (device kind, ranks per node and node count, the P2P / native-atomics /
NVLink matrices of this node's GPUs, the message dtype), measuring it on the running machine,
and a rank's node identity. A node is a torchrun agent (``GROUP_RANK``), not a hostname: two
``torchrun --nnodes 2`` invocations on one machine are two nodes, and single-node backends
must refuse to span them exactly as they would across real hosts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Protocol

import torch

Matrix = tuple[tuple[bool, ...], ...]


@dataclass(frozen=True)
class Topology:
    """One rank's view of the job and of its node's GPUs (GPU i serves local rank i).

    Matrices are indexed by local rank; ``None`` means "could not be measured" (e.g. no NVML),
    which every decision treats as "no".
    """

    device: str  # "cpu" | "cuda"
    world_size: int
    local_world_size: int
    nodes: int = 1
    dtype: torch.dtype | None = None  # the tensors to reduce; None: not known yet
    gpus_visible: int = 0
    capability: tuple[int, int] | None = None
    p2p: Matrix | None = None
    atomics: Matrix | None = None
    nvlink: Matrix | None = None
    multinode_nvlink: bool = False  # one NVLink domain across nodes (e.g. GB200 NVL72)

    def missing_pair(self, matrix: Matrix | None) -> tuple[int, int] | None:
        """The first pair of this node's GPUs without the property, or None if all have it."""
        n = self.local_world_size
        for a in range(n):
            for b in range(n):
                if a != b and not (matrix is not None and a < len(matrix) and b < len(matrix[a])
                                   and matrix[a][b]):
                    return a, b
        return None

    def describe(self) -> str:
        shape = f"{self.nodes} node(s) x {self.local_world_size} rank(s)"
        return f"{self.device}, {shape}" + (f", {self.dtype}" if self.dtype is not None else "")


@dataclass(frozen=True)
class Placement:
    """Where this process sits in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @property
    def nodes(self) -> int:
        return -(-self.world_size // max(1, self.local_world_size))

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Placement:
        env = dict(os.environ) if env is None else env
        world = int(env.get("WORLD_SIZE", 1))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        rank = int(env.get("RANK", 0))
        # torchrun numbers a node's ranks contiguously; GROUP_RANK is the node (agent) index.
        node = int(env.get("GROUP_RANK", rank // max(1, local_world)))
        return cls(rank, world, int(env.get("LOCAL_RANK", 0)), local_world, node)


def host_id() -> str:
    """This machine, across reboots: hostname plus the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def node_key(env: dict[str, str] | None = None) -> str:
    """Equal for two ranks exactly when they share shared memory *and* a torchrun agent."""
    env = dict(os.environ) if env is None else env
    return f"{host_id()}#node{env.get('GROUP_RANK', '0')}"


def node_layout(keys: list[str]) -> list[list[int]]:
    """Ranks grouped by node key, nodes ordered by their lowest rank (rank 0's node first)."""
    order = list(dict.fromkeys(keys))
    return [[r for r, key in enumerate(keys) if key == node] for node in order]


class PeerProbe(Protocol):
    """The GPU facts ``measure`` needs; the real one is ``cuda_probe.CudaPeerProbe``."""

    def device_count(self) -> int: ...
    def capability(self, device: int) -> tuple[int, int]: ...
    def can_access(self, a: int, b: int) -> bool: ...
    def native_atomics(self, a: int, b: int) -> bool | None: ...
    def nvlink(self, a: int, b: int) -> bool | None: ...


def _matrix(n: int, fact: object) -> Matrix | None:
    rows = []
    for a in range(n):
        row = []
        for b in range(n):
            value = True if a == b else fact(a, b)  # type: ignore[operator]
            if value is None:
                return None
            row.append(bool(value))
        rows.append(tuple(row))
    return tuple(rows)


def measure(device: torch.device, placement: Placement, dtype: torch.dtype | None = None,
            probe: PeerProbe | None = None) -> Topology:
    """This rank's Topology; on CUDA it asks the driver and NVML about every local GPU pair."""
    base = Topology(device.type, placement.world_size, placement.local_world_size,
                    placement.nodes, dtype)
    if device.type != "cuda":
        return base
    if probe is None:
        if not torch.cuda.is_available():
            return base
        from comm_backends.cuda_probe import CudaPeerProbe

        probe = CudaPeerProbe()
    count = probe.device_count()
    n = min(placement.local_world_size, count)
    index = device.index if device.index is not None else 0
    return Topology(
        device.type, placement.world_size, placement.local_world_size, placement.nodes, dtype,
        gpus_visible=count, capability=probe.capability(index) if index < count else None,
        p2p=_matrix(n, probe.can_access), atomics=_matrix(n, probe.native_atomics),
        nvlink=_matrix(n, probe.nvlink),
    )
