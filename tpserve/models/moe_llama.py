"""Llama-family attention with MoE feed-forward layers: Qwen3-MoE and Mixtral.

Attention (GQA, rope, Qwen3's q/k norm) is ``llama.py``'s; the feed-forward is a softmax-
routed ``SparseMoE`` (or, for Qwen3-MoE's ``mlp_only_layers``, Llama's dense MLP). Mixtral's
checkpoint calls the MoE ``block_sparse_moe`` (our ``mlp``) and its expert projections ``w1``
(gate), ``w3`` (up), ``w2`` (down).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.errors import ConfigError
from tpserve.layers.moe import SparseMoE
from tpserve.layers.quant import DenseWeights
from tpserve.layers.tp import TPContext
from tpserve.models.config import ModelConfig
from tpserve.models.llama import DecoderLayer, LlamaForCausalLM


class MoELlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, max_position: int) -> None:
        if cfg.quant is not None:
            raise ConfigError(f"FP8 block weights are supported for DeepseekV3ForCausalLM, "
                              f"not yet for {cfg.architecture}")
        super().__init__(cfg, tp, dtype, device, max_position)

    def make_layer(self, index: int, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        moe = cfg.moe
        assert moe is not None
        mlp = (SparseMoE(f"model.layers.{index}.mlp.", cfg.hidden_size, moe, DenseWeights(), tp,
                         dtype, device, self.EXPERT_NAMES)
               if index in moe.moe_layers else None)  # None: Llama's dense MLP
        return DecoderLayer(cfg, tp, dtype, device, mlp)


class Qwen3MoeForCausalLM(MoELlamaForCausalLM):
    pass


class MixtralForCausalLM(MoELlamaForCausalLM):
    CHECKPOINT_RENAMES = ((".mlp.", ".block_sparse_moe."),)
    EXPERT_NAMES = ("w1", "w3", "w2")
