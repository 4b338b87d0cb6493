"""Attention over the paged KV cache: write this step's keys/values, gather, SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.engine.forward_batch import ForwardBatch


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cache: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                    scale: float) -> torch.Tensor:
    """q: [B, Q, Hq, D]; k, v: [B, Q, Hk, D]; cache: ([S, Hk, D], [S, Hk, D]) -> [B, Q, Hq*D]."""
    k_cache, v_cache = cache
    k_cache[batch.write_slots] = k.to(k_cache.dtype)
    v_cache[batch.write_slots] = v.to(v_cache.dtype)
    keys = k_cache[batch.read_slots].transpose(1, 2)  # [B, Hk, T, D]
    values = v_cache[batch.read_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=batch.mask,
        scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    batch_size, queries = q.shape[0], q.shape[1]
    return out.transpose(1, 2).reshape(batch_size, queries, -1)
