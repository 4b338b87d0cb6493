"""Where ``/admin/profile`` writes: one private directory, names checked before any work.

The directory is ``--profile-dir``, else ``$TPSERVE_TRACE_DIR``, else
``$XDG_RUNTIME_DIR/tpserve-traces`` (per-user, 0700 by the login manager), else
``~/.cache/tpserve/traces``; never a shared, predictable ``/tmp`` path another user could
create first. ``trace_files`` creates it 0700 and refuses it when it is a symlink or not
private.
"""

from __future__ import annotations

import os
import re
import time

from tpserve.args import ServerArgs
from tpserve.engine.trace_files import PrivateDirError, check_private_dir

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")
NAME_RULE = "1-100 letters, digits, '.', '_' or '-', not starting with '.'"


class TraceRequestError(ValueError):
    """A trace name or directory problem the client is told about (HTTP 400)."""


def trace_dir(args: ServerArgs) -> str:
    configured = args.profile_dir or os.environ.get("TPSERVE_TRACE_DIR")
    if configured:
        return os.path.abspath(configured)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        return os.path.join(runtime, "tpserve-traces")
    return os.path.join(os.path.expanduser("~"), ".cache", "tpserve", "traces")


def check_name(name: str) -> str:
    if NAME.fullmatch(name) is None:
        raise ValueError(f"invalid trace name {name[:120]!r}: use {NAME_RULE}")
    return name


def trace_path(args: ServerArgs, name: str | None) -> str:
    """The file a trace will be written to, after checking the directory is private."""
    directory = trace_dir(args)
    try:
        check_private_dir(directory)
    except PrivateDirError as exc:
        raise TraceRequestError(str(exc)) from None
    name = name or f"trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    return os.path.join(directory, check_name(name))
