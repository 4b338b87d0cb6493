"""RMSNorm computed in float32 and cast back, matching the Hugging Face reference.

Under torch.compile the mean of squares runs as an opaque op (``tpserve::mean_square``)
executing the same ATen reduction as eager: inductor's own fused reduction sums in a
different order, and the resulting ulp-level differences can flip near-tied greedy tokens.
The pointwise rest of the norm still fuses.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("tpserve::mean_square", mutates_args=())
def mean_square(x: torch.Tensor) -> torch.Tensor:
    """mean(x^2) over the last dim, keepdim (x float32)."""
    return x.pow(2).mean(-1, keepdim=True)


@mean_square.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], 1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        # Eager calls the ops directly (no custom-op dispatch cost); same numerics either way.
        ms = mean_square(x32) if torch.compiler.is_compiling() else x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(ms + self.eps)
        return self.weight * x32.to(dtype)
