"""A faster malloc for the server's host allocations: TCMalloc (or jemalloc) where installed.

Every CPU tensor comes from ``posix_memalign`` (c10 aligns to 64 bytes), and glibc before 2.38
serves aligned requests outside its per-thread cache: a decode step of the demo target
allocates ~100 small tensors (projection outputs, norms, the rotary halves, views) and spent
~14% of its layer stack in glibc's bins (perf, TP = 1, one process). Preloaded, TCMalloc
serves them from its thread caches: that stack 155 -> 138 us a call, and the served demo pair
(TP = 2, shm, plain, batch 1) 1.07x the tokens per second of the same server without it (10
alternating rounds of the five benchmark prompts); jemalloc is close (141 us). The 80 MB bench
model, whose step is its weight stream, is level. vLLM's and SGLang's CPU images preload
TCMalloc for the same reason; here the server does it itself, so the default is the fast
path wherever the library is installed (Debian / Ubuntu: ``libtcmalloc-minimal4``).

A library can only be preloaded before the process starts, so ``python -m tpserve`` (each
torchrun worker too) re-executes itself once with ``LD_PRELOAD`` set, before it imports torch.
``TPSERVE_MALLOC``: ``auto`` (default: the first of ``LIBRARIES`` found), ``off``, or a
library's path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path

ENV = "TPSERVE_MALLOC"
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libjemalloc.so.2")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")
# Set in the re-executed process: a library that fails to preload (the loader only warns)
# must not make the server re-execute itself again and again.
DONE = "TPSERVE_MALLOC_PRELOADED"

Exec = Callable[[str, Sequence[str], MutableMapping[str, str]], None]


def find_library(setting: str, dirs: Sequence[str] = LIBRARY_DIRS) -> str | None:
    """The library ``setting`` asks for: None for ``off`` (or nothing installed), the path
    itself for a path, else the first of ``LIBRARIES`` in ``dirs``."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting if Path(setting).is_file() else None
    for name in LIBRARIES:
        for d in dirs:
            path = Path(d) / name
            if path.is_file():
                return str(path)
    return None


def preloaded(env: Mapping[str, str]) -> str | None:
    """The malloc library ``LD_PRELOAD`` names, if any (``active_malloc`` checks it loaded)."""
    for entry in env.get("LD_PRELOAD", "").replace(":", " ").split():
        if any(key in Path(entry).name for key in ("tcmalloc", "jemalloc", "mimalloc")):
            return entry
    return None


def active_malloc(env: Mapping[str, str], maps: str = "/proc/self/maps") -> str:
    """The malloc this process runs on, for the server info: the preloaded library where the
    loader mapped it (``LD_PRELOAD`` names it, and it is in ``maps``, where that is readable),
    else ``glibc``."""
    path = preloaded(env)
    if path is None:
        return "glibc"
    try:
        mapped = Path(maps).read_text()
    except OSError:
        return path
    return path if os.path.realpath(path) in mapped or path in mapped else "glibc"


def preload_malloc(env: Mapping[str, str], argv: Sequence[str], executable: str,
                   exec_fn: Exec = os.execve, dirs: Sequence[str] = LIBRARY_DIRS) -> None:
    """Re-execute this process (``executable`` with ``argv``) with the chosen library in
    ``LD_PRELOAD``, unless it runs on one already, the user said ``off``, it did so once, or
    none is installed. Returns only when it does not re-execute (or exec fails)."""
    if env.get(DONE) or preloaded(env) is not None:
        return
    path = find_library(env.get(ENV, "auto"), dirs)
    if path is None:
        return
    child = dict(env)
    child["LD_PRELOAD"] = " ".join(p for p in (path, env.get("LD_PRELOAD", "")) if p)
    child[DONE] = "1"
    try:
        exec_fn(executable, list(argv), child)
    except OSError:  # keep serving on glibc's malloc rather than not at all
        return


def preload_for_main() -> None:
    """``python -m tpserve``'s call: this interpreter's own command line."""
    preload_malloc(os.environ, sys.orig_argv, sys.executable)
