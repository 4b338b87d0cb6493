"""Setting up one ``shm`` segment across the ranks of a process group.

Owns the construction-time protocol, the only part of the backend that talks through the
process group: check that all ranks share a node, adopt rank 0's configuration, let rank 0
create the segment (an anonymous memfd, see ``shm_segment``), attach everywhere through its
descriptor, then let rank 0 drop the descriptor once everyone is attached. The segment never
has a name, so a rank dying at any point leaves nothing behind in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch.distributed as dist

from comm_backends.base import BackendUnavailable
from comm_backends.shm_segment import (
    ProcId,
    SegmentRef,
    create_segment,
    map_segment,
    pause_point,
)
from comm_backends.topology import node_key

ConfigT = TypeVar("ConfigT")


@dataclass(frozen=True)
class Attached(Generic[ConfigT]):
    """What a rank holds after the rendezvous."""

    mapping: mmap.mmap
    peers: dict[int, ProcId]  # rank -> process, to notice peers that die
    config: ConfigT  # rank 0's, identical on every rank


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
    dist.all_gather_object(infos, (node_key(), ProcId.current(), config), group=group)
    nodes = sorted({info[0] for info in infos if info is not None})
    if len(nodes) > 1:
        raise BackendUnavailable(f"allreduce backend 'shm' works within one node, but its {world} "
                                 f"ranks span {len(nodes)} nodes: use --allreduce hier or gloo")
    # Rank 0's knobs win so every rank picks the same algorithm and layout for every message.
    config = infos[0][2]
    fd, ref = _share(group, rank, size_of(config))
    try:
        pause_point("shm-attach", rank)
        mapping, error = None, None
        try:
            mapping = map_segment(ref)
        except (OSError, RuntimeError) as exc:
            error = f"rank {rank}: {exc}"
        errors: list[str | None] = [None] * world
        dist.all_gather_object(errors, error, group=group)  # doubles as "everyone is attached"
    finally:
        if fd is not None:
            os.close(fd)  # the mappings keep the memory; it goes with the last of them
    failed = [e for e in errors if e is not None]
    if failed:
        if mapping is not None:
            mapping.close()
        raise RuntimeError("shm allreduce: cannot attach the segment: " + "; ".join(failed))
    peers = {r: info[1] for r, info in enumerate(infos) if info is not None}
    return Attached(mapping, peers, config)


def _share(group: dist.ProcessGroup | None, rank: int, size: int) -> tuple[int | None, SegmentRef]:
    """Rank 0 creates the segment; every rank learns its ref (or rank 0's error)."""
    fd, msg = None, [(None, None)]
    if rank == 0:
        try:
            fd, ref = create_segment(size, "tpserve-shm")
            msg = [(ref, None)]
        except (OSError, RuntimeError) as exc:
            msg = [(None, str(exc))]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    try:
        dist.broadcast_object_list(msg, src=src, group=group)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    ref, error = msg[0]
    if error is not None:
        raise RuntimeError(f"shm allreduce: rank 0 could not create the segment: {error}")
    return fd, ref
