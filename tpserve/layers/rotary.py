"""Rotary position embedding, with Llama-3 and YaRN frequency scaling.

Two layouts: NeoX half-rotation (dimension i pairs with i + D/2: Llama, Qwen, Mixtral) and
GPT-J interleaved pairs (dimension 2i pairs with 2i + 1: DeepSeek's rope part). The
interleaved form returns the rotated pairs de-interleaved (evens then odds), as the
transformers reference does; q and k get the same permutation, so q.k is unchanged.

cos/sin are precomputed once for every position up to the context length and indexed by
position ids, so a step only gathers rows (no trig on the hot path, no shape dependence).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tpserve.layers import fused
from tpserve.models.config import RopeConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """YaRN's multiplier on cos/sin (1 for other rope types)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def softmax_mscale(rope: RopeConfig) -> float:
    """DeepSeek's extra softmax scale under YaRN: mscale(factor, mscale_all_dim) squared."""
    if rope.rope_type != "yarn" or not rope.mscale_all_dim:
        return 1.0
    return yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def _yarn_inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty range
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # high-frequency dimensions keep their original frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    if rope.rope_type == "yarn":
        return _yarn_inverse_frequencies(rope, head_dim)
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
                 device: torch.device, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        inv = inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(rope)
        self.register_buffer("cos", (emb.cos() * scale).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, Hq, D], k: [N, Hk, D], positions: [N]."""
        return self.at(positions, q.dtype)(q, k)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryAt:
        """cos/sin for ``positions`` gathered and cast once, reusable by every layer."""
        cos, sin = fused.rotary_rows(self.cos, self.sin, positions, dtype)
        if self.interleaved:  # one angle per pair: the first half of the doubled table
            half = cos.shape[-1] // 2
            return RotaryAt(cos[..., :half], sin[..., :half], interleaved=True)
        return RotaryAt(cos, sin)


class RotaryAt:
    """A rotary embedding bound to one step's positions: ``(q, k) -> (q, k)`` rotated.

    A decode step otherwise repeats the same gather + cast per layer: 4 small ops x layers
    of pure dispatch overhead at batch 1.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> None:
        self.cos, self.sin = cos, sin
        self.rotate = _rotate_interleaved if interleaved else _rotate

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q, self.cos, self.sin), self.rotate(k, self.cos, self.sin)

    def split_qk(self, qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q [N, q_heads, D] and k [N, kv_heads, D] out of a fused qkv projection
        [N, (q_heads + 2 kv_heads) * D]: one op for the NeoX layout (``fused.rotary_qk``)."""
        if self.rotate is _rotate:
            return fused.rotary_qk(qkv, self.cos, self.sin, q_heads, kv_heads, head_dim)
        return self(*fused.qk_heads(qkv, q_heads, kv_heads, head_dim))


_rotate = fused.rotate_half


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos/sin: [..., D/2]; pairs (x[2i], x[2i+1]) -> out[i], out[i + D/2]."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
