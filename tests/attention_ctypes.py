"""paged_attention.c built alone and called through ctypes (the AVX2 / AVX-512 ISA tests).

``NativeKernel(flags)`` builds the C file with extra compiler flags (``-mno-avx512f``: the AVX2
path) and runs a ``Case`` the way the torch op does: ``attn_write`` for K and V, then
``attn_forward`` (every work item on one thread, then the merges of split items).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from comm_backends.native_build import load_library
from tests.attention_cases import Case
from tpserve.layers.attention import cpu_native

CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class Problem(ctypes.Structure):  # attn_problem in paged_attention.c, field for field
    _fields_ = [
        ("batch", _i64), ("max_pages", _i64), ("page_size", _i64), ("q_heads", _i64),
        ("kv_heads", _i64), ("head_dim", _i64), ("window", _i64), ("scale", ctypes.c_float),
        ("page_table", _ptr), ("q_indptr", _ptr), ("kv_lens", _ptr), ("mask_start", _ptr),
        ("custom_mask", _ptr), ("mask_rows", _i64), ("mask_width", _i64), ("q", _ptr),
        ("q_stride", _i64), ("q_dtype", ctypes.c_int32), ("cache_dtype", ctypes.c_int32),
        ("k_cache", _ptr), ("v_cache", _ptr), ("out", _ptr), ("partials", _ptr),
    ]


class NativeKernel:
    def __init__(self, flags: tuple[str, ...] = ()) -> None:
        source = Path(cpu_native.__file__).with_name("paged_attention.c")
        headers = tuple(h for h in cpu_native.KERNEL if h.suffix == ".h")
        self.lib, self.lanes = load_library(source, "attn_lanes", headers, flags)
        self.lib.attn_forward.argtypes = (ctypes.POINTER(Problem),)
        self.lib.attn_forward.restype = ctypes.c_int32
        self.lib.attn_write.argtypes = (_ptr, _i64, ctypes.c_int32, _ptr, ctypes.c_int32, _ptr,
                                        _i64, _i64, _i64)
        self.lib.attn_write.restype = None

    def write(self, src: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        self.lib.attn_write(src.data_ptr(), src.stride(0), CODES[src.dtype], cache.data_ptr(),
                            CODES[cache.dtype], slots.data_ptr(), src.shape[0], src.shape[1],
                            src.shape[2])

    def run(self, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out [N, Hq * D], k_cache, v_cache) after the write and the attention."""
        kc, vc = case.caches()
        self.write(case.k, kc, case.metadata().write_slots)
        self.write(case.v, vc, case.metadata().write_slots)
        out, problem, _ = self.problem(case, kc, vc)
        self.forward(problem)
        return out, kc, vc

    def forward(self, problem: Problem) -> None:
        if self.lib.attn_forward(ctypes.byref(problem)) != 0:
            raise MemoryError("attn_forward could not allocate its buffers")

    def problem(self, case: Case, kc: torch.Tensor, vc: torch.Tensor
                ) -> tuple[torch.Tensor, Problem, object]:
        """(out, the problem over caches kc/vc, what must stay alive while it is used)."""
        meta = case.metadata()
        spec = case.spec
        out = torch.empty(case.q.shape[0], spec.num_q_heads * spec.head_dim, dtype=case.q.dtype)
        mask = case.custom_mask
        p = Problem(
            batch=meta.batch_size, max_pages=meta.page_table.shape[1], page_size=case.page_size,
            q_heads=spec.num_q_heads, kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            window=spec.window, scale=spec.scale, page_table=meta.page_table.data_ptr(),
            q_indptr=meta.q_indptr.data_ptr(), kv_lens=meta.kv_lens.data_ptr(),
            mask_start=None if mask is None else meta.mask_start.data_ptr(),
            custom_mask=None if mask is None else meta.custom_mask.data_ptr(),
            mask_rows=0 if mask is None else mask.shape[1],
            mask_width=0 if mask is None else mask.shape[2], q=case.q.data_ptr(),
            q_stride=case.q.stride(0), q_dtype=CODES[case.q.dtype],
            cache_dtype=CODES[kc.dtype], k_cache=kc.data_ptr(), v_cache=vc.data_ptr(),
            out=out.data_ptr(), partials=None)
        return out, p, meta
