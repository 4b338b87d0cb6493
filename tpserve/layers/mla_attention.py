"""Attention over a paged latent (MLA) cache: the kernel an MLA attention backend provides.

Cache: one tensor per layer, [slots, 1, kv_lora_rank + qk_rope_head_dim]; a slot holds a
token's normalised compressed kv followed by its rope'd shared key. ``mla_attention`` is the
absorbed form every step can use: the query's no-rope part arrives already multiplied by the
key half of kv_b_proj (width kv_lora_rank), so scores are ``q_latent . c + q_pe . k_pe`` and
the output is the attention-weighted latent (the caller applies the value half). One latent
"head" serves every query head: DeepSeek-V3 caches 576 values per token and layer, where the
same attention with expanded keys and values would cache 128 x (192 + 128) = 40960.

``mla_attention_expanded`` is the prefill alternative: it expands the cached latents into
per-head keys and values (cheaper when the step has many queries per cached key).

Both write this step's latents at ``batch.write_slots`` first, then read ``batch.read_slots``
under ``batch.mask`` (the same metadata as ``attention.paged_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.engine.forward_batch import ForwardBatch


def write_latent(cache: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """Store latent [B, Q, D] at the step's slots; return the read span [B, T, D]."""
    cache[batch.write_slots] = latent.unsqueeze(2).to(cache.dtype)
    return cache[batch.read_slots].squeeze(2)


def mla_attention(q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                  cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache.

    q_latent: [B, Q, H, C] (q_nope folded through kv_b_proj's key half, C = kv_lora_rank);
    q_pe: [B, Q, H, R] (rope'd); latent: [B, Q, C + R] (this step's entries, written first);
    cache: [S, 1, C + R]; scale: the softmax scale. Returns [B, Q, H, C].

    Every head reads the same latent, so heads fold into the query rows: one [Q*H, C+R] x
    [C+R, T] product per sequence instead of SDPA's per-head copies of the keys (SDPA's CPU
    path expands a shared key head to all heads and upcasts each copy). Scores, softmax and
    the weighted sum run in float32, as SDPA's math path does for bf16 inputs.
    """
    b, q_len, heads, width = q_latent.shape
    kv = write_latent(cache, latent, batch).float()  # [B, T, C+R]
    q = torch.cat((q_latent, q_pe), dim=-1).float().reshape(b, q_len * heads, -1)
    scores = torch.bmm(q, kv.transpose(1, 2)).mul_(scale)  # [B, Q*H, T]
    mask = batch.mask[:, 0, :, None, :].expand(b, q_len, heads, -1).reshape(scores.shape)
    probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)
    out = torch.bmm(probs, kv[..., :width])
    return out.view(b, q_len, heads, width).to(q_latent.dtype)


def mla_attention_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                           cache: torch.Tensor, batch: ForwardBatch, scale: float,
                           w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Expanded MLA: per-head keys/values from the cached latents.

    q_nope: [B, Q, H, N]; q_pe: [B, Q, H, R]; w_uk: [H, N, C]; w_uv: [H, V, C].
    Returns [B, Q, H, V].
    """
    kv = write_latent(cache, latent, batch).to(q_nope.dtype)  # [B, T, C+R]
    c, k_pe = kv.split([w_uk.shape[-1], q_pe.shape[-1]], dim=-1)
    keys = torch.einsum("btc,hnc->bhtn", c, w_uk)
    values = torch.einsum("btc,hvc->bhtv", c, w_uv)
    k_pe = k_pe.unsqueeze(1).expand(-1, keys.shape[1], -1, -1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, torch.cat((keys, k_pe), dim=-1), values,
                                         attn_mask=batch.mask, scale=scale)
    return out.transpose(1, 2)
