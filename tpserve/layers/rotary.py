"""Rotary position embedding (NeoX half-rotation layout), with Llama-3 frequency scaling.

cos/sin are precomputed once for every position up to the context length and indexed by
position ids, so a step only gathers rows (no trig on the hot path, no shape dependence).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type != "llama3":
        return inv
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int,
                 device: torch.device) -> None:
        super().__init__()
        inv = inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, Hq, D], k: [N, Hk, D], positions: [N]."""
        return self.at(positions, q.dtype)(q, k)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAt:
        """cos/sin for ``positions`` gathered and cast once, reusable by every layer."""
        return RotaryAt(self.cos[positions].unsqueeze(1).to(dtype),
                        self.sin[positions].unsqueeze(1).to(dtype))


class RotaryAt:
    """A rotary embedding bound to one step's positions: ``(q, k) -> (q, k)`` rotated.

    A decode step otherwise repeats the same gather + cast per layer: 4 small ops x layers
    of pure dispatch overhead at batch 1.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate(q, self.cos, self.sin), _rotate(k, self.cos, self.sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
