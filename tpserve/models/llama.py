"""Tensor-parallel Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2, Qwen3).

Per layer: column-parallel fused qkv and gate/up, row-parallel o and down — exactly two
allreduces per layer. The forward optionally returns the hidden states that enter chosen
layers (EAGLE-3's auxiliary features) without any cost when none are asked for.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.kv_cache import KVLayout
from tpserve.layers import fused
from tpserve.layers.attention import Attend, AttentionBackend, AttentionSpec, bind
from tpserve.layers.attention import create as create_attention
from tpserve.layers.fused_decoder import DecoderStack
from tpserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tpserve.layers.norm import RMSNorm
from tpserve.layers.rotary import RotaryAt, RotaryEmbedding
from tpserve.layers.tp import TPContext, divide
from tpserve.layers.vocab import ParallelLMHead
from tpserve.models.config import ModelConfig
from tpserve.models.decoder_base import DecoderLM

KVPair = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp, dtype, device)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp,
                                        dtype, device)
        self.heads, self.kv_heads = self.qkv_proj.heads_local, self.qkv_proj.kv_heads_local
        self.head_dim = d
        self.scale = d**-0.5
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def attention_spec(self, dtype: torch.dtype, window: int | None) -> AttentionSpec:
        return AttentionSpec(self.heads, self.kv_heads, self.head_dim, self.scale, dtype, window)

    def forward(self, x: torch.Tensor, rotary: RotaryAt, attend: Attend,
                cache: KVPair) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (self.heads + self.kv_heads) * d:].view(n, self.kv_heads, d)
        if self.q_norm is None:  # split and rotate in one op where the rotary layout allows
            q, k = rotary.split_qk(qkv, self.heads, self.kv_heads, d)
        else:
            q, k = fused.qk_heads(qkv, self.heads, self.kv_heads, d)
            q, k = rotary(self.q_norm(q), self.k_norm(k))
        return self.o_proj(attend(q, k, v, cache))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias,
                                                 tp, dtype, device)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp, dtype, device)
        self.inter_local = divide(inter, tp.size, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention + feed-forward; ``mlp`` replaces the dense MLP (MoE families)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp, dtype, device)
        self.mlp = mlp if mlp is not None else MLP(cfg, tp, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rotary: RotaryAt, attend: Attend,
                cache: KVPair) -> torch.Tensor:
        delta = self.self_attn(self.input_layernorm(x), rotary, attend, cache)
        x, h = self.post_attention_layernorm.add_forward(x, delta)
        return x + self.mlp(h)


class LlamaForCausalLM(DecoderLM):
    """Llama family (Llama 2/3, Mistral, Qwen2/3): the shared decoder over GQA layers."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, max_position: int) -> None:
        layers = [self.make_layer(i, cfg, tp, dtype, device) for i in range(cfg.num_layers)]
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_position, device)
        super().__init__(cfg, tp, dtype, device, layers, rotary)

    def make_layer(self, index: int, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        return DecoderLayer(cfg, tp, dtype, device)

    def set_attention_backend(self, name: str) -> None:
        """``--attention-backend``: every layer attends through one backend, prepared per step."""
        weight = self.embed_tokens.weight
        spec = self.layers[0].self_attn.attention_spec(weight.dtype, self.cfg.sliding_window)
        self.attention: AttentionBackend = create_attention(name, spec, weight.device)
        self.refresh_stack()

    def finish_loading(self) -> None:
        super().finish_loading()
        self.refresh_stack()

    def refresh_stack(self) -> None:
        """The native layer stack for the current backend and weights (None where it does not
        apply; ``stack_reason`` says why, for the server info)."""
        self.stack, self.stack_reason = DecoderStack.of(self)

    def forward(self, batch: ForwardBatch, kv: list[KVPair],
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The shared layer loop, or on CPU steps of a few tokens the same layers as native
        ops (``fused_decoder``; bit-equal hidden states)."""
        out = self._stack_forward(batch, kv, aux_layers)
        if out is None:
            return super().forward(batch, kv, aux_layers)
        x, aux = out
        return self.norm(x), aux

    def forward_logits(self, batch: ForwardBatch, kv: list[KVPair]
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(fp32 logits, normed hidden) of a step that the native stack takes, with the final
        norm and one rank's lm_head in one more native call (``tpserve::decoder_head``: the
        same bits as ``forward`` then ``logits``); None where that does not apply and the
        caller runs those two."""
        if self.tp.size != 1 or not self._plain_head():
            return None
        out = self._stack_forward(batch, kv, ())
        if out is None:
            return None
        hidden, logits = torch.ops.tpserve.decoder_head(out[0], self.norm.weight, self.norm.eps,
                                                        self.lm_head.weight)
        return logits, hidden

    def forward_picks(self, batch: ForwardBatch, kv: list[KVPair], aux_layers: tuple[int, ...],
                      rows: torch.Tensor | None
                      ) -> tuple[tuple[list[int], list[float]], list[torch.Tensor]] | None:
        """(greedy picks of ``rows`` (None: every row), auxiliary states) of a step that the
        native stack takes, the final norm run inside the head's native call
        (``ParallelLMHead.greedy``: the same bits as ``forward`` then ``greedy_picks``,
        without ~50 us of Python norm on cold caches); None where that does not apply."""
        if not self._plain_head():
            return None
        out = self._stack_forward(batch, kv, aux_layers)
        if out is None:
            return None
        x, aux = out
        picked = x if rows is None else x.index_select(0, rows)
        return self.lm_head.greedy(picked, (self.norm.weight, self.norm.eps)), aux

    def _plain_head(self) -> bool:
        """The final norm and the head are this module's plain ones (a model that scales or
        caps its logits overrides ``logits``)."""
        return (type(self).logits is DecoderLM.logits and type(self.norm) is RMSNorm
                and type(self.lm_head) is ParallelLMHead)

    def _stack_forward(self, batch: ForwardBatch, kv: list[KVPair], aux_layers: tuple[int, ...]
                       ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The native stack's (un-normed output, auxiliary states), or None (nothing run)
        where it does not take this step."""
        stack = self.stack
        if stack is None or not DecoderStack.fits(batch.input_ids):
            return None
        if self.embed_tokens.collects:
            batch.host_work.run()  # before the step's first collective (HostWork)
        x, cos, sin = self._stack_inputs(batch)
        meta, spec = self.attention.prepare(batch.attn).meta, self.attention.spec
        batch.host_work.run()  # beside the native stack, which holds no GIL (HostWork)
        # The auxiliary states in increasing layer order, as the layer loop returns them.
        at = sorted({i for i in aux_layers if i <= self.cfg.num_layers})
        return stack.run(x, cos, sin, meta, spec.window, spec.scale, kv, at)

    def _stack_inputs(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stack's input rows and the step's rotary cos / sin: in one native call where
        the embedding needs no collective and the rotary pairs are the halves
        (``fused.embed_rotary``)."""
        table = self.embed_tokens.local_table
        if table is None or self.rotary.interleaved:
            x = self.embed_tokens(batch.input_ids)
            rotary = self.rotary.at(batch.positions, x.dtype)
            return x, rotary.cos, rotary.sin
        return fused.embed_rotary(batch.input_ids, table, self.rotary.cos, self.rotary.sin,
                                  batch.positions)

    def bind_attention(self, batch: ForwardBatch) -> Attend:
        return bind(self.attention, batch.attn)  # the per-step preparation, done once

    def kv_layout(self) -> KVLayout:
        """Per-rank KV entries per token and layer (what the engine allocates pages for)."""
        attn = self.layers[0].self_attn
        return KVLayout.gqa(self.cfg.num_layers, attn.kv_heads, attn.head_dim)
