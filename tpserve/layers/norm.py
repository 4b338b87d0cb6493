"""RMSNorm computed in float32 and cast back, matching the Hugging Face reference.

The mean of squares is an opaque op (``tpserve::mean_square``, see ``cpu_ops.cpp``: an fp64
sum in a fixed order on CPU), in eager and compiled decode alike: inductor's own fused
reduction sums in a different order, and the resulting ulp-level differences can flip
near-tied greedy tokens. The pointwise rest of the norm still fuses.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        cpu_ops.load()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        ms = torch.ops.tpserve.mean_square(x32)
        x32 = x32 * torch.rsqrt(ms + self.eps)
        return self.weight * x32.to(dtype)
