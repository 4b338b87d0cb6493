"""Profiler trace files, written only into a private directory and never through a symlink.

The directory must be a real directory (not a symlink) owned by this user with no group or
other permissions; it is created 0700 when missing. Traces are exported to a fresh,
exclusively created temporary file inside it, reached through the directory's open file
descriptor (so a directory swapped after the check is not written), then renamed over the
final name (a rename replaces a planted symlink instead of following it).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from contextlib import suppress


class PrivateDirError(ValueError):
    """The trace directory cannot be created, or is not private to this user."""


def open_private_dir(path: str) -> int:
    """An O_RDONLY descriptor of ``path``, created 0700 if missing; refuses anything else."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PrivateDirError(f"trace directory '{path}' is not usable (a symlink or a file?): "
                              f"{exc.strerror}") from None
    info = os.fstat(fd)
    uid = os.geteuid()
    if info.st_uid != uid or stat.S_IMODE(info.st_mode) & 0o077:
        os.close(fd)
        raise PrivateDirError(
            f"trace directory '{path}' must belong to uid {uid} with mode 0700 (it has uid "
            f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}); fix or remove it, or pass "
            "--profile-dir")
    return fd


def check_private_dir(path: str) -> None:
    os.close(open_private_dir(path))


def write_private(path: str, export: Callable[[str], None]) -> None:
    """Run ``export(tmp_path)``, then atomically move the result to ``path``."""
    directory, name = os.path.split(path)
    fd = open_private_dir(directory)
    try:
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=fd))
        via_fd = f"/proc/self/fd/{fd}"  # the checked directory itself, whatever its path is now
        base = via_fd if os.path.isdir(via_fd) else directory
        try:
            export(os.path.join(base, tmp))
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
    finally:
        os.close(fd)
