"""The EAGLE-3 draft as a plain PyTorch module for training (training-time test).

Parameter names are the published checkpoint names (``fc``, ``midlayer.*``, ``norm``,
``lm_head``), so ``state_dict()`` is the export. The math matches
``tpserve.models.eagle3.Eagle3Draft``: the draft row for token t+1 pairs embed(token t+1) with
the target feature of position t and sits at rotary position t; draft step k (k >= 1) feeds
back the previous step's pre-norm output and sits at position t + k. Its query sees the
step-0 keys of positions <= t (the committed draft KV at inference) plus its own chain's keys
of steps 1..k (the tree ancestors at inference) -- the attention ``unrolled`` builds here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """fp32 statistics, cast back, then scale: the same order as tpserve's RMSNorm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SelfAttn(nn.Module):
    def __init__(self, s: DraftShape) -> None:
        super().__init__()
        d = s.head_dim
        self.q_proj = nn.Linear(2 * s.hidden_size, s.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden_size, s.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden_size, s.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(s.num_heads * d, s.hidden_size, bias=False)


class Mlp(nn.Module):
    def __init__(self, s: DraftShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: DraftShape) -> None:
        super().__init__()
        self.self_attn = SelfAttn(s)
        self.mlp = Mlp(s)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX half-rotation rotary on x [B, heads, T, D] at positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device).float() / d))
    freqs = torch.outer(positions.float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Eagle3Trainable(nn.Module):
    def __init__(self, shape: DraftShape) -> None:
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(3 * shape.target_hidden_size, shape.hidden_size, bias=False)
        self.midlayer = MidLayer(shape)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.draft_vocab_size, bias=False)

    def _qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, step: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m, s = self.midlayer, self.shape
        x = torch.cat((m.input_layernorm(embeds), m.hidden_norm(hidden)), dim=-1)
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device) + step
        q = m.self_attn.q_proj(x).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = m.self_attn.k_proj(x).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = m.self_attn.v_proj(x).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        rep = s.num_heads // s.num_kv_heads  # GQA: query head h reads kv head h // rep
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return rotate(q, pos, s.rope_theta), rotate(k, pos, s.rope_theta), v

    def _attend(self, q: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> torch.Tensor:
        """q [B,h,T,D] over step-0 keys (causal) plus each later step's key at the same row."""
        scale = q.shape[-1] ** -0.5
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        first = (q @ keys[0].transpose(-1, -2)).float() * scale
        first = first.masked_fill(~causal, float("-inf"))
        diag = [(q * k).sum(-1, keepdim=True).float() * scale for k in keys[1:]]
        probs = torch.softmax(torch.cat([first, *diag], dim=-1), dim=-1).to(q.dtype)
        out = probs[..., :t] @ values[0]
        for j, v in enumerate(values[1:]):
            out = out + probs[..., t + j : t + j + 1] * v
        return out

    def unrolled(self, embeds: list[torch.Tensor], features: torch.Tensor) -> list[torch.Tensor]:
        """Draft-vocab logits for each unrolled step.

        ``features`` [B, T, 3*Ht]: target aux states of rows t; ``embeds[k]`` [B, T, H]: the
        embedding of token t + 1 + k (the input of step k at row t).
        """
        m = self.midlayer
        hidden = self.fc(features)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        logits = []
        for step, emb in enumerate(embeds):
            q, k, v = self._qkv(emb, hidden, step)
            keys.append(k)
            values.append(v)
            attn = self._attend(q, keys, values)
            b, _, t, _ = attn.shape
            h = hidden + m.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
            hidden = h + m.mlp(m.post_attention_layernorm(h))
            logits.append(self.lm_head(self.norm(hidden)))
        return logits
