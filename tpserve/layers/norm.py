"""RMSNorm computed in float32 and cast back, matching the Hugging Face reference.

On CPU the whole norm is one opaque op (``tpserve::rms_norm``, ``fused.py``; the mean of
squares an fp64 sum in a fixed order), in eager and compiled decode alike: inductor's own fused
reduction sums in a different order, and the resulting ulp-level differences can flip
near-tied greedy tokens. Elsewhere the mean of squares alone is opaque
(``tpserve::mean_square``) and the pointwise rest fuses.
"""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers import cpu_ops, fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        cpu_ops.load()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a residual add and the norm after it in one pass."""
        return fused.add_rms_norm(x, delta, self.weight, self.eps)
