"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), tensor-parallel over heads.

Projections: q through ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` (or a plain
``q_proj`` when ``q_lora_rank`` is null); ``kv_a_proj_with_mqa`` gives the compressed kv
(``kv_a_layernorm``'d) and one shared rope key; ``kv_b_proj`` maps the compressed kv to
per-head no-rope keys and values; ``o_proj`` is row-parallel (the layer's one allreduce).

Sharding: ``q_b_proj`` / ``q_proj``, ``kv_b_proj`` and ``o_proj`` are split by heads; the
small down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) are replicated, so every rank
computes the whole latent and caches it for its own heads (the cache is per rank).

After loading, ``kv_b_proj`` becomes two per-head matrices (FP8 checkpoints: dequantised,
~2% of DeepSeek-V3's weights): ``w_uk`` [H, nope, C] folds into the query (absorbed
attention) and ``w_uv`` [H, v, C] maps the attended latent to values.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.fp8 import dequantize
from tpserve.layers.mla_attention import BoundMLA
from tpserve.layers.norm import RMSNorm
from tpserve.layers.quant import Fp8ColumnParallelLinear, WeightFormat
from tpserve.layers.rotary import RotaryAt, softmax_mscale
from tpserve.layers.tp import NoComm, TPContext, divide
from tpserve.models.config import MLAConfig, ModelConfig


def expand_min_queries(m: MLAConfig) -> int:
    """Queries per request from which expanding the latent into per-head K/V is cheaper.

    Per cached key and head, expanding costs (nope + v) * C multiply-adds once; per query,
    key and head, absorbed attention costs 2C + R against expanded's nope + R + v. Equal at
    Q = (nope + v) C / (2C - nope - v): 171 for DeepSeek-V3 (C 512, nope 128, v 128) and 128
    for launch/bench_moe.py's shape, whose measured crossover lies between 64 and 256.
    Decode and speculative verify (a few queries) always stay absorbed.
    """
    c, nope, v = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
    return max(2, -(-(nope + v) * c // max(1, 2 * c - nope - v)))

# q_a_layernorm / kv_a_layernorm use the RMSNorm default, not config.rms_norm_eps (as the
# reference implementation does).
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, prefix: str, cfg: ModelConfig, fmt: WeightFormat, tp: TPContext,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.m = m
        self.heads = divide(cfg.num_heads, tp.size, "num_attention_heads")
        # Attributes the engine's memory estimate reads (engine/static_setup.ModelShape).
        self.kv_heads, self.head_dim = 1, m.latent_dim
        single = TPContext(0, 1, NoComm())
        bias = bool(cfg.raw.get("attention_bias", False))
        hidden, q_out = cfg.hidden_size, cfg.num_heads * m.qk_head_dim
        if m.q_lora_rank:
            self.q_a_proj = fmt.column(prefix + "q_a_proj", hidden, [m.q_lora_rank], bias,
                                       single, dtype, device)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = fmt.column(prefix + "q_b_proj", m.q_lora_rank, [q_out], False, tp,
                                       dtype, device)
        else:
            self.q_proj = fmt.column(prefix + "q_proj", hidden, [q_out], False, tp, dtype,
                                     device)
        self.kv_a_proj_with_mqa = fmt.column(prefix + "kv_a_proj_with_mqa", hidden,
                                             [m.latent_dim], bias, single, dtype, device)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = fmt.column(prefix + "kv_b_proj", m.kv_lora_rank,
                                    [cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim)],
                                    False, tp, dtype, device)
        self.o_proj = fmt.row(prefix + "o_proj", cfg.num_heads * m.v_head_dim, hidden, bias,
                              tp, dtype, device)
        self.scale = m.qk_head_dim**-0.5 * softmax_mscale(cfg.rope)
        self.w_uk: nn.Parameter | None = None
        self.w_uv: nn.Parameter | None = None
        self.expand_min_queries = expand_min_queries(m)

    def finish_loading(self) -> None:
        """Split the loaded kv_b_proj into the per-head absorbed matrices."""
        proj = self.kv_b_proj
        w = proj.weight.data
        if isinstance(proj, Fp8ColumnParallelLinear):
            dtype = self.kv_a_layernorm.weight.dtype  # the model dtype
            w = dequantize(w, proj.weight_scale_inv.data, proj.block, dtype)
        w = w.view(self.heads, self.m.qk_nope_head_dim + self.m.v_head_dim, -1)
        nope = self.m.qk_nope_head_dim
        self.w_uk = nn.Parameter(w[:, :nope].contiguous(), requires_grad=False)
        self.w_uv = nn.Parameter(w[:, nope:].contiguous(), requires_grad=False)
        del self.kv_b_proj

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.m.q_lora_rank:
            return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, rotary: RotaryAt, attend: BoundMLA,
                cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        m, n = self.m, x.shape[0]
        q = self._query(x).view(n, self.heads, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        q_pe, k_pe = rotary(q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((self.kv_a_layernorm(c), k_pe.squeeze(1)), dim=-1)
        if attend.max_q_len >= self.expand_min_queries:
            out = attend.expanded(q_nope, q_pe, latent, cache[0], self.scale, self.w_uk,
                                  self.w_uv)
            return self.o_proj(out.reshape(n, -1))
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [N, H, C]
        out = attend.absorbed(q_latent, q_pe, latent, cache[0], self.scale)
        values = torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2))  # [H, N, v]
        return self.o_proj(values.transpose(0, 1).reshape(n, -1))
