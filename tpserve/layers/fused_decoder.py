"""The Llama-family layer stack run by native ops on CPU (``decoder_stack.cpp``).

A batch-1 CPU decode step of the bench model streams its weights in ~2.2 ms and spent ~1.2 ms
more calling ~14 ops a layer from Python. For CPU steps of any size (decode, speculative
verify, mixed steps, prompt chunks) the layers run instead as
``tpserve::decoder_layers`` (the whole stack in one call, one rank) or, under tensor
parallelism, as two calls a layer with this rank's allreduce between them. Same kernels, same
order, same roundings: the hidden states are bit-equal to the Python layers', which still run
the steps this does not take (other devices, compiled steps, models this does not cover).

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
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpserve.layers.tp import TPContext, native_exchange, run_exchanging

# Per layer, decoder_stack.cpp's order: input norm, qkv (weight, bias), o (weight, bias),
# post-attention norm, gate_up (weight, bias), down (weight, bias).
LAYER_TENSORS = 10
KVPair = tuple[torch.Tensor, torch.Tensor]


def _common_reason(attention: Any, rotary: Any) -> str | None:
    """What the target stack and the draft midlayer both need of the model: the switch on,
    the C++ ops, the ``cpu`` attention backend, NeoX rotary."""
    from tpserve.layers.attention.cpu_backend import CpuAttention

    if os.environ.get("TPSERVE_FUSED_DECODER", "1") == "0":
        return "disabled by TPSERVE_FUSED_DECODER=0"
    if cpu_ops.load().impl != "c++":
        return "the C++ ops are not built"
    if not isinstance(attention, CpuAttention):
        return "attention backend is not 'cpu'"
    if rotary.interleaved:
        return "interleaved rotary"
    return None


def _layer_reason(attn: Any, mlp: Any) -> str | None:
    """...and of each layer: no q/k norm, plain dense projections, a dense MLP."""
    from tpserve.models.llama import MLP

    if attn.q_norm is not None:
        return "q/k norm"
    if type(mlp) is not MLP:
        return "not a dense Llama-family layer"
    if (type(attn.qkv_proj) is not QKVParallelLinear or type(attn.o_proj) is not RowParallelLinear
            or type(mlp.gate_up_proj) is not ColumnParallelLinear
            or type(mlp.down_proj) is not RowParallelLinear):
        return "a projection is not a plain dense linear"
    return None


def _unfused_reason(model: Any) -> str | None:
    from tpserve.models.llama import DecoderLayer

    reason = _common_reason(getattr(model, "attention", None), model.rotary)
    if reason is not None:
        return reason
    for layer in model.layers:
        if type(layer) is not DecoderLayer:
            return "not a dense Llama-family layer"
        reason = _layer_reason(layer.self_attn, layer.mlp)
        if reason is not None:
            return reason
    return None


def _reduced(comm: Any, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``RowParallelLinear``'s tail: the allreduce, then the bias once."""
    total = comm.all_reduce(partial)
    return total if bias is None else total + bias


def _layer_tensors(layer: Any) -> list[torch.Tensor | None]:
    attn, mlp = layer.self_attn, layer.mlp
    return [layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
            attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight,
            mlp.down_proj.bias]


@dataclass(frozen=True)
class DecoderStack:
    weights: list[torch.Tensor | None]  # LAYER_TENSORS per layer
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
        weights = [t for layer in model.layers for t in _layer_tensors(layer)]
        attn = model.layers[0].self_attn
        return cls(weights, model.tp, attn.heads, attn.kv_heads, attn.head_dim,
                   model.layers[0].input_layernorm.eps, model.attention.narrow), ""

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        """Steps the native layers take: CPU (tpserve::matmul takes any row count there), not
        inside torch.compile (``--compile`` keeps compiling the Python layers: the ops
        write views of the KV pools, which functionalization would copy whole every step)."""
        return x.is_cpu and not torch.compiler.is_compiling()

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, window: int, scale: float, kv: list[KVPair],
            aux_at: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every layer on ``x`` (the residual stream entering layer 0): the output, and the
        input of each layer in ``aux_at`` (the layer count: the output itself), all from one
        call. Splitting the stack at each auxiliary layer instead (the EAGLE-3 target's
        verify and fed steps: three of them) cost ~40 us of Python and op dispatch a call."""
        step = (cos, sin, meta.page_table, meta.q_indptr, meta.kv_lens, meta.write_slots,
                meta.mask_start, meta.custom_mask, meta.page_size, window, scale)
        dims = (self.q_heads, self.kv_heads, self.head_dim, self.eps, self.narrow)
        k_caches, v_caches = [k for k, _ in kv], [v for _, v in kv]
        if self.tp.size == 1:
            out = torch.ops.tpserve.decoder_layers(x, self.weights, k_caches, v_caches, *step,
                                                   *dims, [], aux_at)
            return out[0], out[1:]
        comm = self.tp.comm
        # Tensor parallel on `shm`: one call, reducing between the halves inside it. Per layer
        # from Python (below) a TP = 2 rank paid two op dispatches and two allreduce calls
        # through the backend's Python layers, ~25 us each beside ~5 us of exchange.
        ex = native_exchange(comm, x.dtype, x.shape)
        if ex is not None:
            out = run_exchanging(comm, ex, 2 * len(kv), x.nbytes, lambda args: (
                torch.ops.tpserve.decoder_layers(x, self.weights, k_caches, v_caches, *step,
                                                 *dims, args, aux_at)))
            return out[0], out[1:]
        # Row-parallel biases (o: w[4], down: w[9]) go after the reduction.
        delta = None
        aux: dict[int, torch.Tensor] = {}
        for i in range(len(kv)):
            if i in aux_at:
                if delta is not None:
                    x, delta = x + delta, None
                aux[i] = x
            w = self.weights[i * LAYER_TENSORS : (i + 1) * LAYER_TENSORS]
            k_cache, v_cache = kv[i]
            x, o = torch.ops.tpserve.decoder_attn_block(x, delta, *w[:4], None, cos, sin,
                                                        k_cache, v_cache, *step[2:], *dims)
            x, m = torch.ops.tpserve.decoder_mlp_block(x, _reduced(comm, o, w[4]), *w[5:9],
                                                       None, self.eps)
            delta = _reduced(comm, m, w[9])
        x = x if delta is None else x + delta
        aux[len(kv)] = x
        return x, [aux[i] for i in aux_at]


def _draft_unfused_reason(draft: Any) -> str | None:
    return (_common_reason(draft.attention, draft.rotary)
            or _layer_reason(draft.self_attn, draft.mlp))


@dataclass(frozen=True)
class DraftBlocks:
    """The EAGLE-3 draft's midlayer as the same two native calls a target layer makes at
    TP > 1: attention over its normed [embed, hidden] concatenation (no norm of its own),
    then the MLP with ``hidden`` as the residual. A draft depth of the demo pair was ~0.7 ms,
    nearly all per-op dispatch. Bit-equal to ``Eagle3Draft.forward``'s Python layer."""

    draft: Any
    # ``grow``'s arguments that only change with the loaded weights, gathered once like
    # DecoderStack's (rebuilding them per call, with the int32 casts, cost ~0.15 ms of a
    # ~0.8 ms tree on the demo pair).
    weights: list[torch.Tensor | None]
    grow_tail: tuple[Any, ...]

    @classmethod
    def of(cls, draft: Any) -> tuple[DraftBlocks | None, str]:
        reason = _draft_unfused_reason(draft)
        if reason is not None:
            return None, reason
        d = draft
        attn, mlp, spec = d.self_attn, d.mlp, d.attention.spec
        weights = [d.input_layernorm.weight, d.hidden_norm.weight, attn.qkv_proj.weight,
                   attn.qkv_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
                   d.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
                   mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias,
                   d.norm.weight, d.lm_head.weight, d.d2t]
        tail = (spec.window, spec.scale, attn.heads, attn.kv_heads, attn.head_dim,
                d.post_attention_layernorm.eps, d.attention.narrow, d.lm_head.vocab)
        return cls(draft, weights, tail), ""

    def run(self, x: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            meta: AttentionMetadata, cache: KVPair) -> torch.Tensor:
        d = self.draft
        attn, mlp, spec = d.self_attn, d.mlp, d.attention.spec
        # One rank: the biases go into the ops; several: after each reduction.
        split = d.tp.size > 1
        o_bias, down_bias = attn.o_proj.bias, mlp.down_proj.bias
        _, o = torch.ops.tpserve.decoder_attn_block(
            x, None, None, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            None if split else o_bias, cos, sin, cache[0], cache[1], meta.page_table,
            meta.q_indptr, meta.kv_lens, meta.write_slots, meta.mask_start, meta.custom_mask,
            meta.page_size, spec.window, spec.scale, attn.heads, attn.kv_heads, attn.head_dim,
            d.post_attention_layernorm.eps, d.attention.narrow)
        if split:
            o = _reduced(d.tp.comm, o, o_bias)
        h, m = torch.ops.tpserve.decoder_mlp_block(
            hidden, o, d.post_attention_layernorm.weight, mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias, mlp.down_proj.weight, None if split else down_bias,
            d.post_attention_layernorm.eps)
        if split:
            m = _reduced(d.tp.comm, m, down_bias)
        return h + m

    def can_grow(self, embed: Any) -> bool:
        """Whether ``grow`` applies: the draft and the embedding it reads are whole on this
        rank (no collective inside)."""
        return (self.draft.tp.size == 1 and getattr(embed, "tp", None) is not None
                and embed.tp.size == 1)

    def grow(self, hidden: torch.Tensor, roots: torch.Tensor, embed: Any, cache: KVPair,
             pages: torch.Tensor, committed: torch.Tensor, topk: int, num_steps: int,
             num_nodes: int, page_size: int,
             extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``spec.eagle.draft_tree`` as one native call (``draft_tree.cpp``): the tree's
        tokens, parents, depths and ancestor masks; writes the temporary nodes' draft KV like
        the loop. ``hidden`` is the root output [B, H], or with ``extend`` = (tokens, lens,
        starts) the pending features [M, H] that ``Drafter._draft_extend`` would write first.
        Bit-equal to the Python path."""
        rotary = self.draft.rotary
        tokens, lens, starts = extend if extend is not None else (None, None, None)
        return torch.ops.tpserve.draft_tree(
            hidden, tokens, _int32(lens), _int32(starts), roots, embed.weight, self.weights,
            cache[0], cache[1], rotary.cos, rotary.sin, _int32(pages), _int32(committed),
            topk, num_steps, num_nodes, page_size, *self.grow_tail)


def _int32(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None or x.dtype == torch.int32 and x.is_contiguous():
        return x
    return x.to(torch.int32).contiguous()
