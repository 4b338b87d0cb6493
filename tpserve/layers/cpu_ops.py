"""tpserve's opaque ops (``tpserve::matmul``, ``tpserve::mean_square``, the fused pointwise ops of
``fused.py``): C++ where it builds.

What the ops do and why they are opaque: ``cpu_ops.cpp``. This module makes sure they exist
before a model runs or is traced:

1. ``cpu_ops.cpp`` (which includes ``gemm.c``: tiles, thread pool) is built with the host C++ compiler against the
   installed torch's headers at first use (~8 s once, then cached by ``native_build``) and
   loaded into the dispatcher. A call then costs ~3 us.
2. Where that fails (no C++ compiler, no headers, ``TPSERVE_CPU_OPS=0``), the same ops are
   defined in Python over ATen (``torch.mv`` / ``F.linear``, pow + mean): ~20 us of dispatch
   per call, and the reason is logged once. There is no thread pool then:
   ``set_matmul_threads`` answers 1.

Either way the fake (shape) functions that torch.compile needs are registered here, and eager
and compiled decode call the same op, so they round the same.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.cpp_extension

from comm_backends.native_build import FLAGS, NativeBuildError, build, compiler
from tpserve.layers import fused

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_DEPENDS = tuple(Path(__file__).parent / n
                 for n in ("gemm.c", "gemm_tiles.c", "gemm_amx.c", "gemm_pool.c", "pool_readahead.c", "half.h",
                           "fused.c", "argmax.c", "logsumexp.c", "silu_mul.c",
                           "attention/attn_simd.h", "decoder_stack.cpp", "draft_tree.cpp",
                           "vocab_pick.cpp"))


def _cxx_flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [*FLAGS, "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-DTPSERVE_TORCH_VERSION=\"{torch.__version__}\"",
            *(f"-I{p}" for p in torch.utils.cpp_extension.include_paths())]


def _link_flags() -> list[str]:
    return [f"-L{Path(torch.__file__).parent / 'lib'}", "-lc10", "-ltorch_cpu"]


def _load_cpp() -> str:
    """Load the C++ ops; returns '' or the reason they are not available."""
    if os.environ.get("TPSERVE_CPU_OPS", "1") == "0":
        return "disabled by TPSERVE_CPU_OPS=0"
    cxx = compiler(cxx=True)
    if cxx is None:
        return "no C++ compiler found (set CXX)"
    try:
        torch.ops.load_library(str(build(_SOURCE, cxx, _cxx_flags(), _DEPENDS, _link_flags())))
    except (NativeBuildError, OSError) as exc:
        return str(exc)
    return ""


def _aten_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mv(weight, x[0])[None] if x.shape[0] == 1 else F.linear(x, weight)


def _define_python_ops() -> torch.library.Library:
    """The fallback: the same schemas, implemented with the ATen ops eager would call."""
    lib = torch.library.Library("tpserve", "DEF")
    lib.define("matmul(Tensor x, Tensor weight) -> Tensor")
    lib.define("mean_square(Tensor x) -> Tensor")
    lib.define("gemm_lanes() -> int")
    lib.define("set_matmul_threads(int threads) -> int")
    lib.define("matmul_threads() -> int")
    lib.define("pool_handle() -> int")
    lib.impl("matmul", _aten_matmul, "CompositeExplicitAutograd")
    lib.impl("mean_square", lambda x: x.pow(2).mean(-1, keepdim=True), "CompositeExplicitAutograd")
    lib.impl("gemm_lanes", lambda: 0, "CompositeExplicitAutograd")
    lib.impl("set_matmul_threads", lambda threads: 1, "CompositeExplicitAutograd")
    lib.impl("matmul_threads", lambda: 1, "CompositeExplicitAutograd")
    lib.impl("pool_handle", lambda: 0, "CompositeExplicitAutograd")
    fused.define_fallbacks(lib)
    return lib


def _register_fakes() -> None:
    @torch.library.register_fake("tpserve::matmul")
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("tpserve::mean_square")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 1)

    fused.register_fakes()


@dataclass(frozen=True)
class LoadedOps:
    impl: str  # "c++" or "python"
    reason: str  # why not C++ ('' when it is)
    # The Python fallback's registration: a Library unregisters its ops when collected, so the
    # cached LoadedOps keeps it alive for the process.
    library: torch.library.Library | None = None


@cache
def load() -> LoadedOps:
    """Define the ops once per process (idempotent; called by every layer that uses them)."""
    reason = _load_cpp()
    library = None
    if reason:
        log.warning("tpserve ops: C++ build unavailable (%s); using Python ops (slower decode)",
                    reason)
        library = _define_python_ops()
    _register_fakes()
    return LoadedOps("python" if reason else "c++", reason, library)


def set_matmul_threads(threads: int) -> int:
    """Threads (caller included) of ``tpserve::matmul``'s pool for this process; returns the
    count in effect (1 with the Python fallback, which has no pool)."""
    load()
    return int(torch.ops.tpserve.set_matmul_threads(threads))
