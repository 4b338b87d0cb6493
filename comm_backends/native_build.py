"""Build a small C or C++ source at first use with the host compiler, cached per machine.

Shared by the ``shm`` exchange (``shm_native``: plain C, loaded with ctypes, built in well
under a second) and tpserve's dispatcher ops (``tpserve.layers.cpu_ops``: C++ against torch's
headers, ~8 s once). Needs nothing but the host ``cc`` / ``c++``, which a fresh CI machine has.

- Flags: ``-O3 -march=native`` (the kernels pick AVX-512 or AVX2 intrinsics at compile time),
  no fast-math (results must be exact and reproducible).
- Cache: ``$TPSERVE_CACHE/native`` or ``~/.cache/tpserve/native``, one file per (sources,
  flags, compiler, CPU model and flags), so an edit, a new compiler, another torch (its version
  is a flag of the C++ build) or another CPU rebuilds.
- Concurrency: written under a temporary name and renamed, so ranks building at once never
  load a half-written library.
- A ctypes library exports an ``int32_t (void)`` function giving its vector width in fp32
  lanes: 0 means the build has no vector path, and callers then keep their torch fallback.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
K = TypeVar("K")

FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fno-fast-math")


class NativeBuildError(RuntimeError):
    """The library could not be built or loaded; the message says why."""


def cache_dir() -> Path:
    root = os.environ.get("TPSERVE_CACHE") or os.path.join(Path.home(), ".cache", "tpserve")
    return Path(root) / "native"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def compiler(cxx: bool = False) -> str | None:
    """The host C (or C++) compiler: ``$CC`` / ``$CXX`` if set, else the usual names."""
    names = ("CXX", "c++", "g++", "clang++") if cxx else ("CC", "cc", "gcc", "clang")
    found = shutil.which(os.environ.get(names[0], names[1]))
    return found or shutil.which(names[2]) or shutil.which(names[3])


def build(source: Path, compiler_path: str, flags: Sequence[str],
          depends: Sequence[Path] = (), libs: Sequence[str] = ()) -> Path:
    """The shared library built from ``source`` (cached; ``depends``: files it includes;
    ``libs``: linker arguments, which must follow the source).

    Raises ``NativeBuildError`` with the compiler's message when the build fails.
    """
    parts = [p.read_bytes() for p in (source, *depends)]
    parts += [" ".join([*flags, *libs]).encode(), compiler_path.encode(), _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    target = cache_dir() / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    tmp = ""
    try:  # an unwritable cache directory is a build failure too: callers fall back
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
        subprocess.run([compiler_path, *flags, str(source), *libs, "-o", tmp], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)  # atomic: a concurrent rank sees the old name or the whole file
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise NativeBuildError(f"building {source.name} into {target.parent} failed ({detail})") from exc
    finally:
        if tmp and os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: Path, lanes_symbol: str, depends: Sequence[Path] = (),
                 extra_flags: Sequence[str] = (), libs: Sequence[str] = ()
                 ) -> tuple[ctypes.CDLL, int]:
    """The compiled C ``source`` (``depends``: files it includes; ``extra_flags``: after
    FLAGS, e.g. ``-mno-avx512f`` to build the AVX2 path; ``libs``: linker arguments) and its
    vector width (``lanes_symbol()``; 0: scalar-only).

    Raises ``NativeBuildError`` with the reason when there is no compiler or the build fails.
    """
    cc = compiler()
    if cc is None:
        raise NativeBuildError("no C compiler found (set CC)")
    path = build(source, cc, (*FLAGS, *extra_flags), depends, libs)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeBuildError(f"loading {path.name} failed ({exc})") from exc
    lanes_fn = getattr(lib, lanes_symbol)
    lanes_fn.restype = ctypes.c_int32
    return lib, int(lanes_fn())


def load_vectorised(source: Path, lanes_symbol: str, switch: str, fallback: str,
                    depends: Sequence[Path] = ()) -> ctypes.CDLL | None:
    """The compiled C ``source``, or None where it should not be used: environment variable
    ``switch`` is ``0``, the build fails, or the build has no vector path.

    The reason is logged once (callers cache the result), naming ``fallback``, what runs
    instead.
    """
    name = source.name
    if os.environ.get(switch, "1") == "0":
        log.info("%s: disabled by %s=0; %s instead", name, switch, fallback)
        return None
    try:
        lib, lanes = load_library(source, lanes_symbol, depends)
    except NativeBuildError as exc:
        log.warning("%s; %s instead", exc, fallback)
        return None
    if lanes == 0:  # scalar-only build: torch's vectorised ops are faster
        log.info("%s: no AVX2/AVX-512 on this CPU; %s instead", name, fallback)
        return None
    return lib


def bind(lib: ctypes.CDLL, symbols: dict[K, str], argtypes: tuple[Any, ...], restype: Any) -> dict[K, Any]:
    """Typed entry points ``{key: symbol}`` of ``lib``, all with one signature."""
    kernels = {}
    for key, symbol in symbols.items():
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = argtypes, restype
        kernels[key] = fn
    return kernels
