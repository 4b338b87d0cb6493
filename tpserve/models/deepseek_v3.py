"""DeepSeek-V3 (and Kimi-K2, the same architecture): MLA attention + DeepSeek MoE.

Per layer: latent attention (``layers/mla.py``) and either a dense gated MLP (the first
``first_k_dense_replace`` layers) or a MoE with sigmoid/noaux_tc routing and shared experts
(``layers/moe.py``): two allreduces per layer either way. The KV cache holds one latent per
token and layer (``kv_lora_rank + qk_rope_head_dim`` values). Checkpoints may be bf16 or FP8
block-scaled (``weights``: the format the registry picked from the checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.kv_cache import KVLayout
from tpserve.layers.mla import MLAttention
from tpserve.layers.mla_attention import BoundMLA
from tpserve.layers.mla_flashinfer import FlashInferBoundMLA, choose_mla_backend
from tpserve.layers.mlp import GatedMLP
from tpserve.layers.moe import SparseMoE
from tpserve.layers.norm import RMSNorm
from tpserve.layers.quant import DenseWeights, WeightFormat
from tpserve.layers.rotary import RotaryAt, RotaryEmbedding
from tpserve.layers.tp import TPContext
from tpserve.models.config import ModelConfig
from tpserve.models.decoder_base import DecoderLM


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, index: int, cfg: ModelConfig, fmt: WeightFormat, tp: TPContext,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        prefix = f"model.layers.{index}."
        self.self_attn = MLAttention(prefix + "self_attn.", cfg, fmt, tp, dtype, device)
        moe = cfg.moe
        self.mlp: nn.Module
        if moe is not None and index in moe.moe_layers:
            self.mlp = SparseMoE(prefix + "mlp.", cfg.hidden_size, moe, fmt, tp, dtype, device)
        else:
            self.mlp = GatedMLP(prefix + "mlp.", cfg.hidden_size, cfg.intermediate_size, fmt, tp,
                                dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, rotary: RotaryAt, attend: BoundMLA,
                cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        delta = self.self_attn(self.input_layernorm(x), rotary, attend, cache)
        x, h = self.post_attention_layernorm.add_forward(x, delta)
        return x + self.mlp(h)


class DeepseekV3ForCausalLM(DecoderLM):
    # "auto" would JIT-compile and self-check FlashInfer's MLA kernel on a GPU, and
    # ``build_model`` chooses again right after loading: start with the backend that needs no probe.
    START_ATTENTION = "mla"

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, max_position: int,
                 weights: WeightFormat | None = None) -> None:
        mla = cfg.mla
        assert mla is not None, "DeepseekV3ForCausalLM needs an MLA config"
        fmt = weights or DenseWeights()
        layers = [DeepseekDecoderLayer(i, cfg, fmt, tp, dtype, device)
                  for i in range(cfg.num_layers)]
        rotary = RotaryEmbedding(cfg.rope, mla.qk_rope_head_dim, max_position, device,
                                 interleaved=mla.rope_interleave)
        super().__init__(cfg, tp, dtype, device, layers, rotary)

    def set_attention_backend(self, name: str) -> None:
        """MLA attends over the latent with its own backends (the GQA kernels cannot read a
        latent cache): FlashInfer's paged MLA kernel for the steps it serves where ``name`` is
        ``auto`` or ``flashinfer`` and it runs and agrees on this GPU, else ``mla``
        (``mla_flashinfer``)."""
        weight, mla = self.embed_tokens.weight, self.cfg.mla
        assert mla is not None
        attn = self.layers[0].self_attn
        self.attention = choose_mla_backend(name, mla.latent_dim, mla.kv_lora_rank,
                                            mla.qk_rope_head_dim, attn.heads, attn.scale,
                                            weight.dtype, weight.device)

    def bind_attention(self, batch: ForwardBatch) -> BoundMLA | FlashInferBoundMLA:
        return self.attention.bind(batch.attn)

    def kv_layout(self) -> KVLayout:
        """One latent per token and layer, the same on every rank."""
        assert self.cfg.mla is not None
        return KVLayout.latent(self.cfg.num_layers, self.cfg.mla.latent_dim)
