"""Llama-family attention with MoE feed-forward layers: Qwen3-MoE and Mixtral.

Attention (GQA, rope, Qwen3's q/k norm) is ``llama.py``'s; the feed-forward is a softmax-
routed ``SparseMoE`` (or, for Qwen3-MoE's ``mlp_only_layers``, Llama's dense MLP). Mixtral's
checkpoint calls the MoE ``block_sparse_moe`` (our ``mlp``) and its expert projections ``w1``
(gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.kv_cache import KVLayout
from tpserve.errors import ConfigError
from tpserve.layers.attention import Attend, bind
from tpserve.layers.attention import create as create_attention
from tpserve.layers.moe import SparseMoE
from tpserve.layers.norm import RMSNorm
from tpserve.layers.quant import DenseWeights
from tpserve.layers.rotary import RotaryAt, RotaryEmbedding
from tpserve.layers.tp import TPContext
from tpserve.models.config import ModelConfig
from tpserve.models.decoder_base import DecoderLM
from tpserve.models.llama import MLP, Attention, KVPair


class MoEDecoderLayer(nn.Module):
    def __init__(self, index: int, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, expert_names: tuple[str, str, str]) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp, dtype, device)
        moe = cfg.moe
        assert moe is not None
        self.mlp: nn.Module
        if index in moe.moe_layers:
            self.mlp = SparseMoE(f"model.layers.{index}.mlp.", cfg.hidden_size, moe,
                                 DenseWeights(), tp, dtype, device, expert_names)
        else:
            self.mlp = MLP(cfg, tp, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rotary: RotaryAt, attend: Attend,
                cache: KVPair) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, attend, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoELlamaForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, max_position: int) -> None:
        if cfg.quant is not None:
            raise ConfigError(f"FP8 block weights are supported for DeepseekV3ForCausalLM, "
                              f"not yet for {cfg.architecture}")
        layers = [MoEDecoderLayer(i, cfg, tp, dtype, device, self.EXPERT_NAMES)
                  for i in range(cfg.num_layers)]
        rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_position, device)
        super().__init__(cfg, tp, dtype, device, layers, rotary)

    def set_attention_backend(self, name: str) -> None:
        weight = self.embed_tokens.weight
        spec = self.layers[0].self_attn.attention_spec(weight.dtype, self.cfg.sliding_window)
        self.attention = create_attention(name, spec, weight.device)

    def bind_attention(self, batch: ForwardBatch) -> Attend:
        return bind(self.attention, batch.attn)

    def kv_layout(self) -> KVLayout:
        attn = self.layers[0].self_attn
        return KVLayout.gqa(self.cfg.num_layers, attn.kv_heads, attn.head_dim)


class Qwen3MoeForCausalLM(MoELlamaForCausalLM):
    pass


class MixtralForCausalLM(MoELlamaForCausalLM):
    CHECKPOINT_RENAMES = ((".mlp.", ".block_sparse_moe."),)
    EXPERT_NAMES = ("w1", "w3", "w2")
