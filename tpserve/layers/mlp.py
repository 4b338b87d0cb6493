"""The SiLU-gated MLP (gate/up column-parallel, down row-parallel) in any weight format.

``forward`` reduces across ranks (a dense layer's one MLP allreduce); ``partial`` returns this
rank's share without reducing, for a MoE layer that adds its shared experts to the routed
experts' partial sums before its single allreduce.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers import fused
from tpserve.layers.quant import WeightFormat, row_partial
from tpserve.layers.tp import TPContext, divide


class GatedMLP(nn.Module):
    def __init__(self, prefix: str, hidden: int, intermediate: int, fmt: WeightFormat,
                 tp: TPContext, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # The fused gate/up is named after its first part; FP8 scales are per part alike.
        self.gate_up_proj = fmt.column(prefix + "gate_proj", hidden, [intermediate] * 2, False,
                                       tp, dtype, device)
        self.down_proj = fmt.row(prefix + "down_proj", intermediate, hidden, False, tp, dtype,
                                 device)
        self.inter_local = divide(intermediate, tp.size, "intermediate_size")

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(self.gate_up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return row_partial(self.down_proj, self._act(x))

    STACKED = (("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1))
