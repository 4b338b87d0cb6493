"""Tensor-parallel Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2, Qwen3).

Per layer: column-parallel fused qkv and gate/up, row-parallel o and down — exactly two
allreduces per layer. The forward optionally returns the hidden states that enter chosen
layers (EAGLE-3's auxiliary features) without any cost when none are asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.kv_cache import KVLayout
from tpserve.layers.attention import paged_attention
from tpserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tpserve.layers.norm import RMSNorm
from tpserve.layers.rotary import RotaryAt, RotaryEmbedding
from tpserve.layers.tp import TPContext, divide
from tpserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tpserve.models.config import ModelConfig

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

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding | RotaryAt, batch: ForwardBatch,
                cache: KVPair) -> torch.Tensor:
        n = x.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(n, self.heads, self.head_dim)
        k = k.reshape(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(batch.positions.reshape(-1), q, k)
        shape = (batch.batch_size, batch.num_queries)
        out = paged_attention(q.reshape(*shape, self.heads, self.head_dim),
                              k.reshape(*shape, self.kv_heads, self.head_dim),
                              v.reshape(*shape, self.kv_heads, self.head_dim),
                              cache, batch, self.scale)
        return self.o_proj(out.reshape(n, -1))


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
        gate, up = self.gate_up_proj(x).split(self.inter_local, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp, dtype, device)
        self.mlp = MLP(cfg, tp, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding | RotaryAt, batch: ForwardBatch,
                cache: KVPair) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # checkpoint suffix -> (our parameter suffix, shard id) for fused projections
    STACKED = (
        ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
        ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, max_position: int) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_position, device)

    def forward(self, batch: ForwardBatch, kv: list[KVPair],
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns final-normed hidden [B*Q, H] and the inputs of ``aux_layers`` (same shape)."""
        x = self.embed_tokens(batch.input_ids.reshape(-1))
        rotary = self.rotary.at(batch.positions.reshape(-1), x.dtype)  # shared by all layers
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            x = layer(x, rotary, batch, kv[i])
        if self.cfg.num_layers in aux_layers:
            aux.append(x)
        return self.norm(x), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_layout(self) -> KVLayout:
        """Per-rank KV entries per token and layer (what the engine allocates pages for)."""
        attn = self.layers[0].self_attn
        return KVLayout.gqa(self.cfg.num_layers, attn.kv_heads, attn.head_dim)

    def checkpoint_names(self) -> dict[str, tuple[str, int | None]]:
        """Map every checkpoint tensor name to (our parameter name, shard id)."""
        mapping: dict[str, tuple[str, int | None]] = {}
        for name, _ in self.named_parameters():
            hf = name if name.startswith("lm_head") else "model." + name
            fused = [(c, o, s) for c, o, s in self.STACKED if f".{o}." in hf]
            for ckpt, ours, shard in fused:
                mapping[hf.replace(f".{ours}.", f".{ckpt}.")] = (name, shard)
            if not fused:
                mapping[hf] = (name, None)
        return mapping
