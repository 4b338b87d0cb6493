"""Pluggable allreduce strategies for tensor parallelism, usable without tpserve.

``create(name, group, device)`` builds a backend by name; ``available(device, world)`` tells
which names can run here. Backends are imported lazily so that CUDA-only modules never load
(or fail) on a CPU machine unless asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist

from comm_backends.base import AllReduce, BackendUnavailable, CommStats

__all__ = ["AllReduce", "BackendUnavailable", "CommStats", "BACKENDS", "create", "available", "resolve_auto"]

# name -> "module:Class"; a read-only mapping, extended by editing this table.
BACKENDS: Mapping[str, str] = MappingProxyType(
    {
        "gloo": "comm_backends.torch_dist:GlooAllReduce",
        "nccl": "comm_backends.torch_dist:NcclAllReduce",
        "shm": "comm_backends.shm:ShmAllReduce",
        "cuda_p2p": "comm_backends.cuda_p2p:CudaP2PAllReduce",
        "symm_mem": "comm_backends.symm_mem:SymmMemAllReduce",
    }
)

# Preference order for `auto`, fastest first, per device type. The rule: a one-host
# shared-memory/P2P path beats a general collective library at the small, latency-bound
# message sizes of decode; fall back to the library when the fast path cannot run.
AUTO_ORDER: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"cpu": ("shm", "gloo"), "cuda": ("cuda_p2p", "symm_mem", "nccl")}
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


def unavailable_reason(name: str, device: torch.device, world_size: int) -> str | None:
    try:
        cls = backend_class(name)
    except BackendUnavailable as exc:
        return str(exc)
    return cls.unavailable_reason(device, world_size)


def available(device: torch.device, world_size: int) -> list[str]:
    return [n for n in BACKENDS if unavailable_reason(n, device, world_size) is None]


def resolve_auto(device: torch.device, world_size: int) -> str:
    for name in AUTO_ORDER.get(device.type, ()):
        if unavailable_reason(name, device, world_size) is None:
            return name
    raise BackendUnavailable(f"no allreduce backend available for {device.type} x {world_size}")


def create(name: str, group: dist.ProcessGroup | None, device: torch.device) -> AllReduce:
    """Build backend ``name`` for ``group`` on ``device``; raises BackendUnavailable."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if name == "auto":
        name = resolve_auto(device, world)
    reason = unavailable_reason(name, device, world)
    if reason is not None:
        raise BackendUnavailable(reason)
    return backend_class(name)(group, device)
