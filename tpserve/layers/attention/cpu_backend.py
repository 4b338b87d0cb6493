"""The ``cpu`` attention backend: one native op per layer (``tpserve::paged_attention``).

The op writes the step's keys/values and walks each request's pages in place (kernel:
paged_attention.c), so a step's metadata is the page table plus O(batch + rows) integers and
nothing is gathered or masked per key.
"""

from __future__ import annotations

import torch

from tpserve.layers.attention import cpu_native
from tpserve.layers.attention.base import AttentionBackend, AttentionSpec, KVPair, PreparedStep

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


class CpuAttention(AttentionBackend):
    name = "cpu"

    @classmethod
    def unavailable_reason(cls, spec: AttentionSpec, device: torch.device) -> str | None:
        if device.type != "cpu":
            return f"runs on CPU only, not {device.type}"
        if spec.dtype not in DTYPES:
            return f"KV cache dtype {spec.dtype} is not one of fp32/bf16/fp16"
        native = cpu_native.load()
        if native.reason:
            return native.reason
        multiple = native.head_dim_multiple
        if native.op_for(spec.head_dim) is None or spec.head_dim > MAX_HEAD_DIM:
            return (f"head_dim {spec.head_dim} must be a multiple of {multiple} and at most "
                    f"{MAX_HEAD_DIM} on this CPU")
        if spec.num_q_heads % spec.num_kv_heads:
            return "query heads must be a multiple of KV heads"
        return None

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        name = cpu_native.load().op_for(spec.head_dim) or "paged_attention"
        # The AVX2 build beside an AVX-512 one, for head sizes the wide one cannot take.
        self.narrow = name != "paged_attention"
        self.op = getattr(torch.ops.tpserve, name)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPair,
                step: PreparedStep) -> torch.Tensor:
        meta = step.meta
        return self.op(
            q, k, v, cache[0], cache[1], meta.page_table, meta.q_indptr, meta.kv_lens,
            meta.write_slots, meta.mask_start, meta.custom_mask, meta.page_size,
            self.spec.window, self.spec.scale)
