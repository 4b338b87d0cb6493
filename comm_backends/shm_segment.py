"""The memory behind an ``shm`` segment, and the process identities of the ranks using it.

Owns creating a segment (an anonymous ``memfd``: mode 0600, its memory reserved up front),
letting peer processes of the same node map it, and telling whether a peer process is still
alive (pid plus start time, so a reused pid or a zombie does not pass).

A memfd has no name in /dev/shm at any moment, so no rank dying at any point of start-up or
serving can leave a file behind: the memory goes when the last process holding it exits.
Peers reach the creator's descriptor through ``/proc/<pid>/fd/<fd>`` (same user, same node,
same pid namespace: what torchrun's ranks of one node are); the inode is checked on open, so
a reused descriptor number cannot attach anyone to the wrong memory.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import time
from dataclasses import dataclass

# Set to "<where>:<rank>" (e.g. "control-attach:1") to make that rank stop at that point of
# start-up: tests kill it there to prove nothing leaks whichever rank dies when.
PAUSE_ENV = "TPSERVE_PAUSE_AT"


def pause_point(where: str, rank: int) -> None:
    if os.environ.get(PAUSE_ENV) == f"{where}:{rank}":
        print(f"tpserve: rank {rank} (pid {os.getpid()}) paused at {where} ({PAUSE_ENV})",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(60)


@dataclass(frozen=True)
class SegmentRef:
    """How a peer process of this node finds a segment: owner pid, descriptor and inode."""

    pid: int
    fd: int
    inode: int
    size: int


@dataclass(frozen=True)
class ProcId:
    """A process identity that survives pid reuse: pid plus its kernel start time."""

    pid: int
    start_time: int | None

    @classmethod
    def current(cls) -> ProcId:
        return cls(os.getpid(), proc_start_time(os.getpid()))


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat, or None where /proc does not show the process."""
    state = _proc_stat(pid)
    return None if state is None else state[1]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses; fields after it do not.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def proc_alive(proc: ProcId) -> bool:
    """False once ``proc`` has exited; a zombie (killed, not yet reaped) counts as dead."""
    if proc.start_time is None:  # no /proc view of it: fall back to signal 0
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    state = _proc_stat(proc.pid)
    return state is not None and state[0] not in ("Z", "X") and state[1] == proc.start_time


def create_segment(size: int, label: str) -> tuple[int, SegmentRef]:
    """A fresh segment of ``size`` bytes: (descriptor to keep open until peers attached, ref).

    Reserving the memory up front turns "not enough shared memory" into an error here instead
    of a SIGBUS on first touch in the middle of an allreduce.
    """
    fd = os.memfd_create(label, os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise RuntimeError(
                    f"shared memory: cannot reserve {size >> 20} MiB ({exc.strerror}); raise the "
                    "memory limit or lower TPSERVE_SHM_BUFFER_BYTES"
                ) from exc
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    except BaseException:
        os.close(fd)
        raise
    return fd, SegmentRef(os.getpid(), fd, os.fstat(fd).st_ino, size)


def map_segment(ref: SegmentRef) -> mmap.mmap:
    """Map ``ref``'s memory (the owner maps its own descriptor; peers go through /proc)."""
    if ref.pid == os.getpid():
        return mmap.mmap(ref.fd, ref.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_ino != ref.inode or st.st_size != ref.size:
            raise RuntimeError(f"shared memory: descriptor {ref.fd} of pid {ref.pid} is not the "
                               f"segment ({st.st_size} bytes, expected {ref.size})")
        return mmap.mmap(fd, ref.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory alive on its own
