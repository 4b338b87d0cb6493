"""Mixture-of-experts layer: routing, routed experts, shared experts, one allreduce.

Parallelism (``TPContext.ep_size``):

- tensor parallel (ep_size 1): every rank holds every expert, split like an MLP (gate/up
  rows and down columns by rank); each rank's output is a partial sum over its slice;
- expert parallel (ep_size = TP size): expert e lives whole on rank e // (E / ep); a rank
  computes only its experts, for every token routed to them, and leaves zeros elsewhere.

Either way the routed output, plus the shared experts' tensor-parallel partial sum, is a
per-rank partial of the layer's output, and the layer does exactly one allreduce.

Expert compute (``experts.py``): tokens are sorted by expert and each expert with tokens
runs one batched matmul over its contiguous slice.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.experts import ExpertStack
from tpserve.layers.mlp import GatedMLP
from tpserve.layers.quant import WeightFormat
from tpserve.layers.router import Router
from tpserve.layers.tp import TPContext
from tpserve.models.config_families import MoEConfig


class SparseMoE(nn.Module):
    def __init__(self, prefix: str, hidden: int, cfg: MoEConfig, fmt: WeightFormat,
                 tp: TPContext, dtype: torch.dtype, device: torch.device,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                 ) -> None:
        super().__init__()
        self.tp = tp
        self.gate = Router(hidden, cfg, device)
        block = fmt.block_for(f"{prefix}experts.0.{expert_names[0]}")
        self.experts = ExpertStack(hidden, cfg, tp, dtype, device, block)
        self.shared_experts = (
            GatedMLP(prefix + "shared_experts.", hidden, cfg.shared_intermediate_size, fmt, tp,
                     dtype, device) if cfg.shared_intermediate_size else None)
        # Rough activation width for start-up memory estimates (engine/static_setup.py).
        self.inter_local = (cfg.top_k * self.experts.inter_local
                            + (self.shared_experts.inter_local if self.shared_experts else 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x)
        return self.tp.comm.all_reduce(out)
