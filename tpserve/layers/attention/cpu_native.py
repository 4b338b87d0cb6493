"""Builds and loads ``tpserve::paged_attention`` (cpu_attention.cpp + paged_attention.c).

Built at first use with the host C++ compiler against the installed torch's headers (cached
by ``native_build`` per source, flags, compiler and CPU, so the AVX-512 or AVX2 path is the one
this machine runs). Where torch's intra-op pool is OpenMP the library is compiled with
``-fopenmp``: it then links the ``libgomp.so.1`` torch has already loaded (same soname), so
its work items run on torch's threads; without OpenMP it runs on the calling thread.
``TPSERVE_CPU_ATTENTION=0`` turns the op off (the ``cpu`` backend then reports why).

On an AVX-512 machine the same source is also built for the AVX2 path under suffixed names
(``tpserve::paged_attention_narrow``, 8 lanes: head_dim a multiple of 16 instead of 32), so
models with 16-wide heads (the built-in demo pair) attend natively too; ``op_for`` says which
op serves a head size. Measured on the demo pair at TP=1 (head_dim 16): a 4-deep draft phase
spent ~40% of its time preparing and running the torch backend's gather + SDPA.

Where ``tpserve::matmul``'s C++ pool is loaded, the op's work items run on that pool instead
(``tpserve::paged_attention_use_pool``), and ``threaded`` says so too. A decode step then does
not touch OpenMP: its fork-join barrier waits for every team thread, and on a machine with as
many busy threads as cores (the HTTP thread, a second server, a build) one descheduled thread
held each region for milliseconds (a 32000-wide exp took 4.7 ms on 2 threads, 8 us on one).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.utils.cpp_extension

from comm_backends.native_build import FLAGS, NativeBuildError, build, compiler
from tpserve.layers import cpu_ops

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
KERNEL = (*(Path(__file__).with_name(n) for n in ("paged_attention.c", "attn_simd.h",
                                                  "attn_rows.h")),
          Path(__file__).parent.parent / "half.h")  # shared with gemm_tiles.c


NARROW = "_narrow"  # op-name suffix of the AVX2 build on AVX-512 machines


@dataclass(frozen=True)
class NativeAttention:
    reason: str  # '' when the op is loaded and has a vector path
    lanes: int  # fp32 lanes of the loaded build (16 AVX-512, 8 AVX2), 0 when not loaded
    threaded: bool  # work items run on several threads (the matmul pool, or torch's OpenMP)
    narrow_lanes: int = 0  # lanes of the AVX2 build beside an AVX-512 one (0: none)

    @property
    def head_dim_multiple(self) -> int:
        """The smallest head_dim step some loaded build serves."""
        return 2 * (self.narrow_lanes or self.lanes)

    def op_for(self, head_dim: int) -> str | None:
        """Name of the op (in ``torch.ops.tpserve``) for ``head_dim``; None when none fits."""
        if self.lanes and head_dim % (2 * self.lanes) == 0:
            return "paged_attention"
        if self.narrow_lanes and head_dim % (2 * self.narrow_lanes) == 0:
            return "paged_attention" + NARROW
        return None


def _openmp_torch() -> bool:
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


def _flags(openmp: bool) -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [*FLAGS, "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-DTPSERVE_TORCH_VERSION=\"{torch.__version__}\"",
            *(["-fopenmp"] if openmp else []),
            *(f"-I{p}" for p in torch.utils.cpp_extension.include_paths())]


def _libs() -> list[str]:
    return [f"-L{Path(torch.__file__).parent / 'lib'}", "-lc10", "-ltorch_cpu"]


def _build_and_load(extra: tuple[str, ...] = ()) -> tuple[str, bool]:
    """Load the op (built with ``extra`` flags too); returns ('' or why not, whether it is
    threaded)."""
    if os.environ.get("TPSERVE_CPU_ATTENTION", "1") == "0":
        return "disabled by TPSERVE_CPU_ATTENTION=0", False
    cxx = compiler(cxx=True)
    if cxx is None:
        return "no C++ compiler found (set CXX)", False
    failure = ""
    for openmp in ((True, False) if _openmp_torch() else (False,)):
        try:
            path = build(SOURCE, cxx, [*_flags(openmp), *extra], KERNEL, _libs())
            torch.ops.load_library(str(path))
            return "", openmp
        except (NativeBuildError, OSError) as exc:
            failure = str(exc)
            log.info("paged attention build (openmp=%s) failed: %s", openmp, exc)
    return failure, False


def _load_narrow(pool: int) -> int:
    """The AVX2 build's lanes (8) beside an AVX-512 one, or 0 where it does not build."""
    reason, _ = _build_and_load(("-mno-avx512f", f"-DTPSERVE_ATTN_SUFFIX={NARROW}"))
    if reason:
        log.info("narrow (AVX2) paged attention unavailable: %s", reason)
        return 0
    ops = torch.ops.tpserve
    lanes = int(getattr(ops, "paged_attention_lanes" + NARROW)())
    if lanes:
        _register_fake("paged_attention" + NARROW)
        getattr(ops, "paged_attention_use_pool" + NARROW)(pool)
    return lanes


def _register_fake(name: str = "paged_attention") -> None:
    @torch.library.register_fake(f"tpserve::{name}")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
          v_cache: torch.Tensor, page_table: torch.Tensor, q_indptr: torch.Tensor,
          kv_lens: torch.Tensor, write_slots: torch.Tensor, mask_start: torch.Tensor | None,
          custom_mask: torch.Tensor | None, page_size: int, window: int,
          scale: float) -> torch.Tensor:
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@cache
def load() -> NativeAttention:
    """Build and register the op once per process (idempotent)."""
    reason, threaded = _build_and_load()
    if reason:
        log.warning("native CPU attention unavailable (%s)", reason)
        return NativeAttention(reason, 0, False)
    lanes = int(torch.ops.tpserve.paged_attention_lanes())
    if lanes == 0:
        return NativeAttention("this CPU has neither AVX-512 nor AVX2+FMA+F16C", 0, threaded)
    _register_fake()
    pool = int(torch.ops.tpserve.pool_handle()) if cpu_ops.load().impl == "c++" else 0
    pooled = bool(torch.ops.tpserve.paged_attention_use_pool(pool))
    narrow = _load_narrow(pool) if lanes == 16 else 0
    return NativeAttention("", lanes, threaded or pooled, narrow)
