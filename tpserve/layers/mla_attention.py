"""The MLA attention backend: attention over a paged latent cache, ragged query rows.

Cache: one tensor per layer, [slots, 1, kv_lora_rank + qk_rope_head_dim]; a slot holds a
token's normalised compressed kv followed by its rope'd shared key. ``absorbed`` is the form
every step can use: the query's no-rope part arrives already multiplied by the key half of
kv_b_proj (width kv_lora_rank), so scores are ``q_latent . c + q_pe . k_pe`` and the output is
the attention-weighted latent (the caller applies the value half). One latent "head" serves
every query head: DeepSeek-V3 caches 576 values per token and layer, where the same attention
with expanded keys and values would cache 128 x (192 + 128) = 40960.

``expanded`` is the prefill alternative: it expands the cached latents into per-head keys and
values (cheaper when the step has many queries per cached key).

Both write this step's latents at the metadata's write slots first. The per-step preparation
(key slots of the pages actually used, the visibility mask, ragged <-> padded rows) is the
``torch`` GQA backend's, so speculative masks, windows and mixed batches mean the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.layers.attention.base import AttentionSpec
from tpserve.layers.attention.metadata import AttentionMetadata
from tpserve.layers.attention.torch_backend import TorchAttention, TorchStep


@dataclass(frozen=True)
class BoundMLA:
    """One step's prepared MLA attention, handed to every layer."""

    step: TorchStep

    @property
    def max_q_len(self) -> int:
        return self.step.meta.max_q_len

    def _read(self, cache: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        cache[self.step.meta.write_slots] = latent.unsqueeze(1).to(cache.dtype)
        return cache[self.step.key_slots].squeeze(2)  # [B, T, C + R]

    def _padded(self, q: torch.Tensor) -> torch.Tensor:
        """Ragged rows [N, H, D] -> [B, Qmax, H, D] (missing rows are zeros)."""
        return torch.cat([q, q.new_zeros(1, *q.shape[1:])])[self.step.q_rows]

    def _ragged(self, out: torch.Tensor) -> torch.Tensor:
        """[B, Qmax, H, D] -> the step's rows [N, H, D]; rows that see no key are zeros."""
        rows = out.reshape(-1, *out.shape[2:])[self.step.out_rows]
        if self.step.blind_rows is not None:
            rows = rows.masked_fill(self.step.blind_rows[:, None, None], 0)
        return rows

    def absorbed(self, q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q_latent [N, H, C], q_pe [N, H, R], latent [N, C + R] -> [N, H, C].

        Every head reads the same latent, so heads fold into the query rows: one
        [Q*H, C+R] x [C+R, T] product per sequence instead of SDPA's per-head copies of the
        keys. Scores, softmax and the weighted sum run in float32, as SDPA's math path does.
        """
        heads, width = q_latent.shape[1], q_latent.shape[2]
        kv = self._read(cache, latent).float()
        q = self._padded(torch.cat((q_latent, q_pe), dim=-1))
        b, q_max = q.shape[:2]
        scores = torch.bmm(q.float().reshape(b, q_max * heads, -1), kv.transpose(1, 2))
        mask = self.step.mask[:, 0, :, None, :].expand(b, q_max, heads, -1)
        scores = scores.mul_(scale).masked_fill_(~mask.reshape(scores.shape), float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), kv[..., :width])
        return self._ragged(out.view(b, q_max, heads, width)).to(q_latent.dtype)

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 cache: torch.Tensor, scale: float, w_uk: torch.Tensor,
                 w_uv: torch.Tensor) -> torch.Tensor:
        """q_nope [N, H, nope], q_pe [N, H, R]; w_uk [H, nope, C], w_uv [H, v, C] -> [N, H, v]."""
        kv = self._read(cache, latent).to(q_nope.dtype)
        c, k_pe = kv.split([w_uk.shape[-1], q_pe.shape[-1]], dim=-1)
        keys = torch.einsum("btc,hnc->bhtn", c, w_uk)
        values = torch.einsum("btc,hvc->bhtv", c, w_uv)
        k_pe = k_pe.unsqueeze(1).expand(-1, keys.shape[1], -1, -1)
        q = self._padded(torch.cat((q_nope, q_pe), dim=-1)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, torch.cat((keys, k_pe), dim=-1), values,
                                             attn_mask=self.step.mask, scale=scale)
        return self._ragged(out.transpose(1, 2))


class MLABackend:
    """Prepares a step once for every MLA layer (``bind``)."""

    name = "mla"

    def __init__(self, latent_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        # Only the visibility rules of the torch backend are used: one latent "head", no window.
        self._prep = TorchAttention(AttentionSpec(1, 1, latent_dim, 1.0, dtype), device)

    def bind(self, meta: AttentionMetadata) -> BoundMLA:
        return BoundMLA(self._prep.prepare(meta))
