"""The attention tpserve ran before the backends, kept as bench_attention's baseline.

Each step expanded its plan into padded [B, Q] write slots, [B, T] read slots (T: the longest
request's keys, rounded up to a page) and a dense [B, 1, Q, T] mask on the host; each layer then
wrote K/V, gathered every readable slot into [B, Hk, T, D] and ran masked SDPA. Causal steps
only (what the benchmark times); the speculative masks of that path are not reproduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PaddedStep:
    write_slots: torch.Tensor  # [B, Q] int64; padded queries write the dummy slot 0
    read_slots: torch.Tensor  # [B, T] int64; padded keys read the dummy slot 0
    mask: torch.Tensor  # [B, 1, Q, T] bool


def _slots(pages: torch.Tensor, logical: torch.Tensor, page_size: int) -> torch.Tensor:
    page_idx = (logical // page_size).clamp(max=pages.shape[1] - 1)
    return torch.gather(pages, 1, page_idx) * page_size + logical % page_size


def padded_step(q_lens: np.ndarray, cached_lens: np.ndarray, page_table: np.ndarray,
                page_size: int) -> PaddedStep:
    """The old per-step expansion (build_forward_batch before the ragged metadata)."""
    q_lens_t, cached = torch.from_numpy(q_lens).long(), torch.from_numpy(cached_lens).long()
    pages = torch.from_numpy(page_table).long()
    batch, queries = len(q_lens), int(q_lens.max())
    total = cached + q_lens_t
    span = -(-int(total.max()) // page_size) * page_size
    j = torch.arange(queries)
    real_q = j[None, :] < q_lens_t[:, None]
    write = torch.where(real_q, _slots(pages, cached[:, None] + j[None, :], page_size), 0)
    t = torch.arange(span)
    real_t = t[None, :] < total[:, None]
    read = torch.where(real_t, _slots(pages, t[None, :].expand(batch, span), page_size), 0)
    q_index = cached[:, None] + j[None, :]
    mask = (t[None, None, :] <= q_index[:, :, None]) & real_t[:, None, :] & real_q[:, :, None]
    mask[:, :, 0] |= ~real_q
    return PaddedStep(write, read, mask[:, None])


def gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache: tuple[torch.Tensor, torch.Tensor], step: PaddedStep,
                     scale: float) -> torch.Tensor:
    """q: [B, Q, Hq, D]; k, v: [B, Q, Hk, D] -> [B, Q, Hq * D] (the old paged_attention)."""
    k_cache, v_cache = cache
    k_cache[step.write_slots] = k.to(k_cache.dtype)
    v_cache[step.write_slots] = v.to(v_cache.dtype)
    keys = k_cache[step.read_slots].transpose(1, 2)  # [B, Hk, T, D]
    values = v_cache[step.read_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=step.mask,
        scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)
