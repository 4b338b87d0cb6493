"""Pluggable allreduce strategies for tensor parallelism, usable without tpserve.

``create(name, group, device)`` builds a backend by name; ``refusal(name, topo)`` says why one
cannot run on a measured ``Topology`` (None when it can); ``choose(topo)`` is what ``auto``
means there, with its reason. Backends are imported lazily so that CUDA-only modules never
load (or fail) on a CPU machine unless asked for.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist

from comm_backends.base import AllReduce, BackendUnavailable, CommStats, one_line
from comm_backends.choice import Choice, NoBackend, choose_backend
from comm_backends.topology import Placement, Topology, measure

__all__ = ["AllReduce", "BackendUnavailable", "CommStats", "BACKENDS", "Choice", "Topology",
           "create", "available", "choose", "refusal", "refusals", "resolve_auto",
           "unavailable_reason", "measure_here", "agree_on", "merge_views"]

# name -> "module:Class"; a read-only mapping, extended by editing this table.
BACKENDS: Mapping[str, str] = MappingProxyType(
    {
        "gloo": "comm_backends.torch_dist:GlooAllReduce",
        "nccl": "comm_backends.torch_dist:NcclAllReduce",
        "shm": "comm_backends.shm:ShmAllReduce",
        "cuda_p2p": "comm_backends.cuda_p2p:CudaP2PAllReduce",
        "symm_mem": "comm_backends.symm_mem:SymmMemAllReduce",
        "hier": "comm_backends.hier:HierAllReduce",
    }
)


def backend_class(name: str) -> type[AllReduce]:
    if name not in BACKENDS:
        raise BackendUnavailable(f"unknown allreduce backend '{name}' (known: {', '.join(BACKENDS)})")
    module_name, cls_name = BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:  # a backend whose module is missing is simply unavailable
        raise BackendUnavailable(f"allreduce backend '{name}' cannot be imported: {exc}") from exc
    return getattr(module, cls_name)


def refusal(name: str, topo: Topology, environment: bool = True) -> str | None:
    """Why backend ``name`` cannot run on ``topo`` (None: it can). ``environment=False`` judges
    the topology alone (pure), leaving out this machine's imports, builds and devices."""
    try:
        cls = backend_class(name)
    except BackendUnavailable as exc:
        return str(exc)
    # The environment first: "needs CUDA" says more than what a GPU-less topology lacks.
    reason = cls.environment_refusal(torch.device(topo.device)) if environment else None
    return reason if reason is not None else cls.topology_refusal(topo)


def refusals(topo: Topology, names: Iterable[str] = BACKENDS, environment: bool = True
             ) -> dict[str, str]:
    found = {name: refusal(name, topo, environment) for name in names}
    return {name: reason for name, reason in found.items() if reason is not None}


def agree_on(topo: Topology, names: Iterable[str] = BACKENDS,
             group: dist.ProcessGroup | None = None) -> tuple[Topology, dict[str, str]]:
    """Rank 0's topology and every backend of ``names`` refused on *any* rank of ``group``: the
    same on every rank. A backend's set-up is collective, so a rank that refuses one alone
    would leave the others waiting in it; with this they all skip it together."""
    refused = refusals(topo, names)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return topo, refused
    views: list[tuple[Topology, dict[str, str]]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(views, (topo, refused), group=group)
    return merge_views(dict(enumerate(views)), dist.get_rank(group))


def merge_views(views: Mapping[int, tuple[Topology, Mapping[str, str]]], me: int
                ) -> tuple[Topology, dict[str, str]]:
    """What a group of ranks decides from alike, given each rank's (topology, refusals): the
    lowest rank's topology, and every backend any of them refuses (another rank's reason
    labelled with its rank, ``me``'s as it is)."""
    union: dict[str, str] = {}
    for rank in sorted(views):
        for name, reason in views[rank][1].items():
            union.setdefault(name, reason if rank == me else f"rank {rank}: {reason}")
    return views[min(views)][0], union


def choose(topo: Topology, refused: Mapping[str, str] | None = None) -> Choice:
    """What ``auto`` means on ``topo``; raises BackendUnavailable when nothing can run."""
    try:
        return choose_backend(topo, refusals(topo) if refused is None else refused)
    except NoBackend as exc:
        raise BackendUnavailable(str(exc)) from None


def measure_here(device: torch.device, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None) -> Topology:
    """This rank's topology: world from ``group`` (or the environment), nodes from torchrun's."""
    placement = Placement.from_env()
    if dist.is_initialized():
        world = dist.get_world_size(group)
        # A subgroup's node layout is not torchrun's: single-node backends check it themselves.
        local = placement.local_world_size if group is None and "LOCAL_WORLD_SIZE" in os.environ else world
        placement = Placement(dist.get_rank(group), world, placement.local_rank, local,
                              placement.node_rank)
    return measure(device, placement, dtype)


def unavailable_reason(name: str, device: torch.device, world_size: int) -> str | None:
    """Why ``name`` cannot run here for ``world_size`` ranks on this one node (None: it can)."""
    return refusal(name, measure(device, Placement(0, world_size, 0, world_size, 0)))


def available(device: torch.device, world_size: int) -> list[str]:
    return [n for n in BACKENDS if unavailable_reason(n, device, world_size) is None]


def resolve_auto(device: torch.device, world_size: int) -> str:
    return choose(measure(device, Placement(0, world_size, 0, world_size, 0))).name


def create(name: str, group: dist.ProcessGroup | None, device: torch.device,
           topo: Topology | None = None) -> AllReduce:
    """Build backend ``name`` for ``group`` on ``device``; raises BackendUnavailable (one line)."""
    topo = measure_here(device, group) if topo is None else topo
    if name == "auto":
        name = choose(topo).name
    reason = refusal(name, topo)
    if reason is not None:
        raise BackendUnavailable(reason)
    try:
        return backend_class(name)(group, device)
    except BackendUnavailable:
        raise
    except (RuntimeError, OSError) as exc:  # set-up failed (driver, IPC, memory): say so in one line
        raise BackendUnavailable(f"allreduce backend '{name}' failed to set up: {one_line(exc)}") from exc
