"""The file behind an ``shm`` segment, and the process identities of the ranks using it.

Owns creating a private (0600, O_EXCL) file in /dev/shm with its memory reserved up front,
mapping it, sweeping files that crashed creators left behind, and telling whether a peer
process is still alive (pid plus start time, so a reused pid or a zombie does not pass).
Removing the name once every rank has attached is the rendezvous' job (``shm_rendezvous``).
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
NAME_PREFIX = "tpserve_shm_"
# A segment file still carrying a name after this long can only come from a creator that died
# between create and unlink (the live window is a few collective round trips).
_STALE_AGE_S = 60.0


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


def remove_stale_segments(directory: str = SHM_DIR) -> None:
    """Unlink our own segment files left by creators that died before unlinking them."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(NAME_PREFIX)]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            pid = int(name[len(NAME_PREFIX) :].split("_", 1)[0])
            st = os.stat(path)
        except (ValueError, OSError):
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < _STALE_AGE_S:
            continue
        if not proc_alive(ProcId(pid, proc_start_time(pid))):
            try:
                os.unlink(path)
            except OSError:
                pass


def create_segment_file(path: str, size: int) -> None:
    """Create ``path`` (mode 0600, must not exist) and reserve ``size`` bytes of tmpfs.

    Reserving up front turns "/dev/shm is too small" into an error here instead of a SIGBUS
    on first touch in the middle of an allreduce.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise RuntimeError(
                    f"shared memory: cannot reserve {size >> 20} MiB in {SHM_DIR} ({exc.strerror}); "
                    "enlarge it (docker --shm-size) or lower TPSERVE_SHM_BUFFER_BYTES"
                ) from exc
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def map_segment_file(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise RuntimeError(f"shared memory: segment {path} has {actual} bytes, expected {size}")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping keeps the memory alive on its own
