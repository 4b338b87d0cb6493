"""The Llama-family layer stack run by native ops on CPU (``decoder_stack.cpp``).

A batch-1 CPU decode step of the bench model streams its weights in ~2.2 ms and spent ~1.2 ms
more calling ~14 ops a layer from Python. For steps of at most ``NATIVE_MATMUL_ROWS`` tokens
(decode, speculative verify, small mixed steps) the layers run instead as
``tpserve::decoder_layers`` (the whole stack in one call, one rank) or, under tensor
parallelism, as two calls a layer with this rank's allreduce between them. Same kernels, same
order, same roundings: the hidden states are bit-equal to the Python layers', which still run
every other step (prefill chunks, other devices, models this does not cover).

``DecoderStack.of(model)`` says whether a model qualifies (and why not):
``llama.DecoderLayer`` layers with a dense MLP, NeoX rotary, no q/k norm, plain 16/32-bit
projections, the ``cpu`` attention backend, the C++ ops loaded. ``TPSERVE_FUSED_DECODER=0``
keeps the Python layers (for A/B runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tpserve.layers import cpu_ops
from tpserve.layers.attention.base import AttentionMetadata
from tpserve.layers.linear import (
    NATIVE_MATMUL_ROWS,
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpserve.layers.tp import TPContext

# Per layer, decoder_stack.cpp's order: input norm, qkv (weight, bias), o (weight, bias),
# post-attention norm, gate_up (weight, bias), down (weight, bias).
LAYER_TENSORS = 10
KVPair = tuple[torch.Tensor, torch.Tensor]


def _unfused_reason(model: Any) -> str | None:
    from tpserve.layers.attention.cpu_backend import CpuAttention
    from tpserve.models.llama import MLP, DecoderLayer

    if os.environ.get("TPSERVE_FUSED_DECODER", "1") == "0":
        return "disabled by TPSERVE_FUSED_DECODER=0"
    if cpu_ops.load().impl != "c++":
        return "the C++ ops are not built"
    if not isinstance(getattr(model, "attention", None), CpuAttention):
        return "attention backend is not 'cpu'"
    if model.rotary.interleaved:
        return "interleaved rotary"
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if type(layer) is not DecoderLayer or type(layer.mlp) is not MLP:
            return "not a dense Llama-family layer"
        if attn.q_norm is not None:
            return "q/k norm"
        if (type(attn.qkv_proj) is not QKVParallelLinear
                or type(attn.o_proj) is not RowParallelLinear
                or type(layer.mlp.gate_up_proj) is not ColumnParallelLinear
                or type(layer.mlp.down_proj) is not RowParallelLinear):
            return "a projection is not a plain dense linear"
    return None


def _layer_tensors(layer: Any, reduced_later: bool) -> list[torch.Tensor | None]:
    """One layer's tensors; row-parallel biases go after the reduction (so: not to the op)
    when ``reduced_later``."""
    attn, mlp = layer.self_attn, layer.mlp
    return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
            attn.o_proj.weight, None if reduced_later else attn.o_proj.bias,
            layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
            mlp.down_proj.weight, None if reduced_later else mlp.down_proj.bias]


@dataclass(frozen=True)
class DecoderStack:
    weights: list[torch.Tensor | None]  # LAYER_TENSORS per layer
    row_biases: list[tuple[torch.Tensor | None, torch.Tensor | None]]  # (o, down), TP > 1
    tp: TPContext
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    narrow: bool  # the attention backend calls tpserve::paged_attention_narrow

    @classmethod
    def of(cls, model: Any) -> tuple[DecoderStack | None, str]:
        """The stack for ``model``'s loaded weights, or (None, why not)."""
        reason = _unfused_reason(model)
        if reason is not None:
            return None, reason
        split = model.tp.size > 1
        weights = [t for layer in model.layers for t in _layer_tensors(layer, split)]
        biases = [(layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias)
                  for layer in model.layers]
        attn = model.layers[0].self_attn
        return cls(weights, biases, model.tp, attn.heads, attn.kv_heads, attn.head_dim,
                   model.layers[0].input_layernorm.eps, model.attention.narrow), ""

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        """Steps the native layers take: CPU, at most as many tokens as tpserve::matmul does,
        not inside torch.compile (``--compile`` keeps compiling the Python layers: the ops
        write views of the KV pools, which functionalization would copy whole every step)."""
        return x.is_cpu and x.shape[0] <= NATIVE_MATMUL_ROWS and not torch.compiler.is_compiling()

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, window: int, scale: float, kv: list[KVPair],
            start: int, end: int) -> torch.Tensor:
        """Layers [start, end) on ``x`` (the residual stream entering layer ``start``)."""
        step = (cos, sin, meta.page_table, meta.q_indptr, meta.kv_lens, meta.write_slots,
                meta.mask_start, meta.custom_mask, meta.page_size, window, scale)
        dims = (self.q_heads, self.kv_heads, self.head_dim, self.eps, self.narrow)
        if self.tp.size == 1:
            return torch.ops.tpserve.decoder_layers(
                x, self.weights[start * LAYER_TENSORS : end * LAYER_TENSORS],
                [k for k, _ in kv[start:end]], [v for _, v in kv[start:end]], *step, *dims)
        comm, delta = self.tp.comm, None
        for i in range(start, end):
            w = self.weights[i * LAYER_TENSORS : (i + 1) * LAYER_TENSORS]
            k_cache, v_cache = kv[i]
            x, o = torch.ops.tpserve.decoder_attn_block(x, delta, *w[:5], cos, sin, k_cache,
                                                        v_cache, *step[2:], *dims)
            o_bias, down_bias = self.row_biases[i]
            o = comm.all_reduce(o)
            x, m = torch.ops.tpserve.decoder_mlp_block(x, o if o_bias is None else o + o_bias,
                                                       *w[5:], self.eps)
            m = comm.all_reduce(m)
            delta = m if down_bias is None else m + down_bias
        return x if delta is None else x + delta


def _draft_unfused_reason(draft: Any) -> str | None:
    from tpserve.layers.attention.cpu_backend import CpuAttention
    from tpserve.models.llama import MLP

    if os.environ.get("TPSERVE_FUSED_DECODER", "1") == "0":
        return "disabled by TPSERVE_FUSED_DECODER=0"
    if cpu_ops.load().impl != "c++":
        return "the C++ ops are not built"
    if not isinstance(draft.attention, CpuAttention):
        return "attention backend is not 'cpu'"
    attn = draft.self_attn
    if draft.rotary.interleaved or attn.q_norm is not None:
        return "interleaved rotary or q/k norm"
    if (type(attn.qkv_proj) is not QKVParallelLinear or type(attn.o_proj) is not RowParallelLinear
            or type(draft.mlp) is not MLP):
        return "a projection is not a plain dense linear"
    return None


@dataclass(frozen=True)
class DraftBlocks:
    """The EAGLE-3 draft's midlayer as the same two native calls a target layer makes at
    TP > 1: attention over its normed [embed, hidden] concatenation (no norm of its own),
    then the MLP with ``hidden`` as the residual. A draft depth of the demo pair was ~0.7 ms,
    nearly all per-op dispatch. Bit-equal to ``Eagle3Draft.forward``'s Python layer."""

    draft: Any
    narrow: bool

    @classmethod
    def of(cls, draft: Any) -> tuple[DraftBlocks | None, str]:
        reason = _draft_unfused_reason(draft)
        if reason is not None:
            return None, reason
        return cls(draft, draft.attention.narrow), ""

    def run(self, x: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, cache: KVPair) -> torch.Tensor:
        d = self.draft
        attn, mlp, spec = d.self_attn, d.mlp, d.attention.spec
        split = d.tp.size > 1
        o_bias, down_bias = attn.o_proj.bias, mlp.down_proj.bias
        _, o = torch.ops.tpserve.decoder_attn_block(
            x, None, None, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            None if split else o_bias, cos, sin, cache[0], cache[1], meta.page_table,
            meta.q_indptr, meta.kv_lens, meta.write_slots, meta.mask_start, meta.custom_mask,
            meta.page_size, spec.window, spec.scale, attn.heads, attn.kv_heads, attn.head_dim,
            d.post_attention_layernorm.eps, self.narrow)
        if split:
            o = d.tp.comm.all_reduce(o)
            o = o if o_bias is None else o + o_bias
        h, m = torch.ops.tpserve.decoder_mlp_block(
            hidden, o, d.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias, mlp.down_proj.weight, None if split else down_bias,
            d.post_attention_layernorm.eps)
        if split:
            m = d.tp.comm.all_reduce(m)
            m = m if down_bias is None else m + down_bias
        return h + m
