"""The ``hier`` backend: allreduce within each node, then across nodes, then back.

1. ``local``: allreduce within the node over its fast backend (``shm`` on CPU; on CUDA what
   ``auto`` would pick for one node of this size: ``cuda_p2p``/``symm_mem`` on NVLink, else NCCL;
   decided from the node leader's topology minus what any rank of the node refuses, so all
   ranks of a node build the same one).
2. ``cross``: allreduce of the node sums among one leader per node (the node's lowest rank)
   over gloo (CPU) or NCCL (CUDA): one message per node crosses the network, not one per rank.
3. ``broadcast``: the leader's total back to its node: the other ranks zero their buffer and
   the node allreduces again (x + 0 is exact, so every rank gets the leader's bits).

16-bit inputs are widened to fp32 for all three phases and rounded once at the end, as the
flat backends do, so results differ from a flat sum only by fp32 summation order. Each phase's
time is recorded in ``stats.parts`` (on CUDA only while profiling: timing needs syncs).
Node identity is torchrun's (``topology.node_key``), so two torchrun "nodes" on one machine
behave exactly like two hosts.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from comm_backends.base import AllReduce, BackendUnavailable
from comm_backends.topology import Placement, Topology, measure, node_key, node_layout

PARTS = ("local", "cross", "broadcast")


class HierAllReduce(AllReduce):
    """Node-local reduce, cross-node reduce among leaders, node-local broadcast."""

    name: ClassVar[str] = "hier"
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")

    @classmethod
    def environment_refusal(cls, device: torch.device) -> str | None:
        reason = super().environment_refusal(device)
        if reason is None:
            import comm_backends

            inner = "shm" if device.type == "cpu" else "nccl"
            found = comm_backends.backend_class(inner).environment_refusal(device)
            reason = None if found is None else f"allreduce backend 'hier' needs '{inner}': {found}"
        return reason

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        super().__init__(group, device)
        self._local: AllReduce | None = None
        self._cross: AllReduce | None = None
        self.is_leader = True
        self.nodes = 1
        if self.world_size > 1:
            self._setup()
        # Capture-safe exactly when its parts are (on CUDA: nccl, cuda_p2p or symm_mem, and
        # NCCL across nodes): the rest of a call is tensor work on the device, and it times
        # its parts (a device sync) only while statistics are on, which capture turns off.
        # Per instance, since it depends on what this node built.
        self.capture_safe = all(inner.capture_safe for inner in (self._local, self._cross)
                                if inner is not None)  # type: ignore[misc]

    def _setup(self) -> None:
        objects = self._object_group()  # built once: every rank creates the same groups
        keys: list[Any] = [None] * self.world_size
        dist.all_gather_object(keys, node_key(), group=objects)
        members = node_layout(keys)
        self.nodes = len(members)

        def global_ranks(ranks: list[int]) -> list[int]:
            return [dist.get_global_rank(self.group, r) if self.group else r for r in ranks]

        backend = "gloo" if self.device.type == "cpu" else None
        # Collective over the whole group: every rank creates every group, in the same order.
        node_groups = [dist.new_group(global_ranks(m), backend=backend) for m in members]
        leaders = dist.new_group(global_ranks([m[0] for m in members]), backend=backend)
        mine = next(i for i, m in enumerate(members) if self.rank in m)
        self.is_leader = members[mine][0] == self.rank
        # Every rank's view of its own node, so that a node's ranks all build the same local
        # backend (a rank-divergent choice would hang in the backends' collective set-up).
        views: list[Any] = [None] * self.world_size
        dist.all_gather_object(views, self._local_view(len(members[mine])), group=objects)
        if len(members[mine]) > 1:
            name = self._local_name({r: views[r] for r in members[mine]}, self.rank)
            self._local = self._build(name, node_groups[mine])
        if self.nodes > 1 and self.is_leader:
            self._cross = self._build("gloo" if self.device.type == "cpu" else "nccl", leaders)

    def _object_group(self) -> dist.ProcessGroup | None:
        if "gloo" in str(dist.get_backend(self.group)):
            return self.group
        return dist.new_group(backend="gloo") if self.group is None else self.group

    def _local_view(self, size: int) -> tuple[Topology, dict[str, str]] | None:
        """This rank's topology of a node of ``size`` ranks and the local candidates it refuses
        (None on CPU, where the local backend is always ``shm``, and for a node of one rank)."""
        if self.device.type == "cpu" or size < 2:
            return None
        import comm_backends

        topo = measure(self.device, Placement(0, size, 0, size, 0))
        return topo, comm_backends.refusals(topo, ("nccl", "cuda_p2p", "symm_mem"))

    def _local_name(self, views: Mapping[int, tuple[Topology, dict[str, str]]], me: int) -> str:
        """The node's local backend from its ranks' views (by rank): what ``auto`` picks for
        the node leader's topology, leaving out what any rank of the node refuses
        (``comm_backends.merge_views``). The same on every rank of the node."""
        if self.device.type == "cpu":
            return "shm"
        import comm_backends

        topo, refused = comm_backends.merge_views(views, me)
        return comm_backends.choose(topo, {**refused, "hier": "nested", "gloo": "cpu"}).name

    def _build(self, name: str, group: dist.ProcessGroup) -> AllReduce:
        import comm_backends

        reason = comm_backends.backend_class(name).environment_refusal(self.device)
        if reason is not None:
            raise BackendUnavailable(f"allreduce backend 'hier' needs '{name}': {reason}")
        return comm_backends.backend_class(name)(group, self.device)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        wide = tensor.float() if tensor.dtype in (torch.bfloat16, torch.float16) else tensor
        timed = not tensor.is_cuda or self.stats.enabled
        mark = time.perf_counter()
        for part in PARTS:
            if part == "local" and self._local is not None:
                wide = self._local.all_reduce(wide)
            elif part == "cross" and self._cross is not None:
                wide = self._cross.all_reduce(wide)
            elif part == "broadcast" and self._local is not None and self.nodes > 1:
                if not self.is_leader:
                    wide.zero_()
                wide = self._local.all_reduce(wide)
            else:
                continue
            if timed:
                if tensor.is_cuda:
                    torch.cuda.synchronize(tensor.device)
                now = time.perf_counter()
                self.stats.record_part(part, now - mark)
                mark = now
        if wide is not tensor:
            tensor.copy_(wide)
        return tensor

    def check(self) -> None:
        for inner in (self._local, self._cross):
            if inner is not None:
                inner.check()

    def close(self) -> None:
        for inner in (self._local, self._cross):
            if inner is not None:
                inner.close()
        self._local = self._cross = None
