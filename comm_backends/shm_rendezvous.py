"""Setting up one ``shm`` segment across the ranks of a process group.

Owns the construction-time protocol, the only part of the backend that talks through the
process group: check that all ranks share a host, adopt rank 0's configuration, let rank 0
create the segment file under a fresh random name, attach everywhere, then unlink the name as
soon as everyone is attached (so a crash at any later point leaves nothing in /dev/shm).
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.distributed as dist

from comm_backends.base import BackendUnavailable
from comm_backends.shm_segment import (
    NAME_PREFIX,
    SHM_DIR,
    ProcId,
    create_segment_file,
    map_segment_file,
    remove_stale_segments,
)

ConfigT = TypeVar("ConfigT")


@dataclass(frozen=True)
class Attached(Generic[ConfigT]):
    """What a rank holds after the rendezvous."""

    mapping: mmap.mmap
    peers: dict[int, ProcId]  # rank -> process, to notice peers that die
    config: ConfigT  # rank 0's, identical on every rank


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def setup_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A CPU-capable group over the same ranks for the object collectives below."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    if group is None:  # NCCL-only default group: every rank builds the same gloo twin
        return dist.new_group(backend="gloo")
    raise BackendUnavailable("allreduce backend 'shm' needs a process group with gloo for setup")


def attach(
    group: dist.ProcessGroup | None, rank: int, world: int, config: ConfigT,
    size_of: Callable[[ConfigT], int],
) -> Attached[ConfigT]:
    """Collective: every rank of ``group`` maps the same fresh segment of ``size_of(config)``."""
    infos: list[tuple[str, ProcId, ConfigT] | None] = [None] * world
    dist.all_gather_object(infos, (host_id(), ProcId.current(), config), group=group)
    hosts = sorted({info[0] for info in infos if info is not None})
    if len(hosts) > 1:
        raise BackendUnavailable(f"allreduce backend 'shm' needs all ranks on one host, got {hosts}")
    # Rank 0's knobs win so every rank picks the same algorithm and layout for every message.
    config = infos[0][2]
    size = size_of(config)
    path = _share_path(group, rank, size)
    mapping, error = None, None
    try:
        mapping = map_segment_file(path, size)
    except (OSError, RuntimeError) as exc:
        error = f"rank {rank}: {exc}"
    errors: list[str | None] = [None] * world
    dist.all_gather_object(errors, error, group=group)  # doubles as "everyone is attached"
    if rank == 0:
        os.unlink(path)  # mappings stay valid; no name is left to leak, even on SIGKILL
    failed = [e for e in errors if e is not None]
    if failed:
        if mapping is not None:
            mapping.close()
        raise RuntimeError("shm allreduce: cannot attach the segment: " + "; ".join(failed))
    peers = {r: info[1] for r, info in enumerate(infos) if info is not None}
    return Attached(mapping, peers, config)


def _share_path(group: dist.ProcessGroup | None, rank: int, size: int) -> str:
    """Rank 0 creates the segment file; every rank learns its path (or rank 0's error)."""
    msg: list[tuple[str, str | None]] = [("", None)]
    if rank == 0:
        # pid + random token: unique across jobs, groups and servers sharing this host.
        path = os.path.join(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(8)}")
        try:
            remove_stale_segments()
            create_segment_file(path, size)
            msg = [(path, None)]
        except (OSError, RuntimeError) as exc:
            msg = [(path, str(exc))]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(msg, src=src, group=group)
    path, error = msg[0]
    if error is not None:
        raise RuntimeError(f"shm allreduce: rank 0 could not create {path}: {error}")
    return path
