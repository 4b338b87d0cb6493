"""The ``torch`` attention backend: gather the used pages, masked SDPA. Any device.

The reference and fallback: simple rather than fast. Per step it builds the slots of every
request's keys up to the longest request in the batch (pages actually used, never the context
limit) and a [B, 1, Qmax, T] mask; per layer it gathers those slots and runs SDPA. Rows that see
no key at all (possible only with a custom mask) come out as zeros, like the native kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpserve.layers.attention.base import AttentionBackend, AttentionSpec, KVPair, PreparedStep
from tpserve.layers.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class TorchStep(PreparedStep):
    key_slots: torch.Tensor  # [B, T] int64 (slot 0 past a request's keys)
    mask: torch.Tensor  # [B, 1, Qmax, T] bool
    q_rows: torch.Tensor  # [B, Qmax] int64 row of q (N: a zero row) for each padded query
    out_rows: torch.Tensor  # [N] int64 row of the padded [B * Qmax] output for each query
    blind_rows: torch.Tensor | None  # [N] bool rows that see no key, or None when there are none


def _visible(meta: AttentionMetadata, window: int, queries: int, keys: int) -> torch.Tensor:
    """[B, Qmax, T] bool: query j of request b may attend to key t."""
    device = meta.kv_lens.device
    kv = meta.kv_lens.long()[:, None, None]
    q_len = (meta.q_indptr[1:] - meta.q_indptr[:-1]).long()[:, None, None]
    j = torch.arange(queries, device=device)[None, :, None]
    t = torch.arange(keys, device=device)[None, None, :]
    at = kv - q_len + j  # logical index of each query
    if meta.custom_mask is None:
        mask = t <= at
    else:
        start = meta.mask_start.long()[:, None, None]
        width = meta.custom_mask.shape[2]
        rel = (t - start).expand(-1, queries, -1)
        rows = meta.custom_mask[:, :queries].gather(2, rel.clamp(0, max(width - 1, 0)))
        mask = (t < start) | ((rel >= 0) & (rel < width) & rows)
    mask = mask & (t < kv) & (j < q_len)
    if window:
        mask &= t > at - window
    return mask


class TorchAttention(AttentionBackend):
    name = "torch"

    @classmethod
    def unavailable_reason(cls, spec: AttentionSpec, device: torch.device) -> str | None:
        if spec.num_q_heads % spec.num_kv_heads:
            return "query heads must be a multiple of KV heads"
        return None

    def prepare(self, meta: AttentionMetadata) -> TorchStep:
        device = meta.kv_lens.device
        batch, queries, keys = meta.batch_size, max(meta.max_q_len, 1), max(meta.max_kv_len, 1)
        t = torch.arange(keys, device=device)
        pages = meta.page_table.long().gather(
            1, (t // meta.page_size).clamp(max=meta.page_table.shape[1] - 1).expand(batch, -1))
        key_slots = torch.where(t < meta.kv_lens[:, None], pages * meta.page_size
                                + t % meta.page_size, 0)
        mask = _visible(meta, self.spec.window, queries, keys)
        blind = ~mask.any(-1)  # padded or maskless rows: point them at key 0 (no NaN)
        mask[:, :, 0] |= blind
        q_len = (meta.q_indptr[1:] - meta.q_indptr[:-1]).long()
        j = torch.arange(queries, device=device)
        real = j[None, :] < q_len[:, None]
        q_rows = torch.where(real, meta.q_indptr[:-1, None].long() + j, meta.num_rows)
        out_rows = torch.arange(batch * queries, device=device).view(batch, queries)[real]
        blind_rows = blind[real]
        return TorchStep(meta, key_slots, mask[:, None], q_rows, out_rows,
                         blind_rows if bool(blind_rows.any()) else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPair,
                step: PreparedStep) -> torch.Tensor:
        assert isinstance(step, TorchStep)
        k_cache, v_cache = cache
        k_cache[step.meta.write_slots] = k.to(k_cache.dtype)
        v_cache[step.meta.write_slots] = v.to(v_cache.dtype)
        keys = k_cache[step.key_slots].transpose(1, 2).to(q.dtype)  # [B, Hk, T, D]
        values = v_cache[step.key_slots].transpose(1, 2).to(q.dtype)
        padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[step.q_rows]  # [B, Qmax, Hq, D]
        out = F.scaled_dot_product_attention(
            padded.transpose(1, 2), keys, values, attn_mask=step.mask, scale=self.spec.scale,
            enable_gqa=q.shape[1] != k.shape[1])
        rows = out.transpose(1, 2).reshape(-1, q.shape[1] * q.shape[2])[step.out_rows]
        if step.blind_rows is not None:
            rows = rows.masked_fill(step.blind_rows[:, None], 0)
        return rows
