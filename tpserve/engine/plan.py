"""Expanding a step's compact layout (tokens, lengths, page table) into padded tensors.

Messages between ranks carry only integers (``engine/messages.py``); each rank calls
``build_forward_batch`` on what it received, so every rank builds identical tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tpserve.engine.forward_batch import ForwardBatch


class BatchLayout(Protocol):
    """What a forward needs to know about its batch (``ForwardStep`` and ``SpecStep`` have it)."""

    @property
    def token_ids(self) -> np.ndarray: ...  # [B, Q] int64, padded with 0

    @property
    def q_lens(self) -> np.ndarray: ...  # [B]: tokens fed this step per request

    @property
    def cached_lens(self) -> np.ndarray: ...  # [B]: tokens already in the cache

    @property
    def page_table(self) -> np.ndarray: ...  # [B, P] page ids covering cached + q_len tokens


@dataclass(frozen=True)
class Layout:
    """A batch layout built on a rank itself (draft extend, verify), never sent."""

    token_ids: np.ndarray
    q_lens: np.ndarray
    cached_lens: np.ndarray
    page_table: np.ndarray


def build_forward_batch(plan: BatchLayout, page_size: int, sliding_window: int | None,
                        device: torch.device, tree_mask: torch.Tensor | None = None,
                        depths: torch.Tensor | None = None) -> ForwardBatch:
    """Expand a plan into padded tensors.

    Query j of request b sits at logical index cached + j in the request's slot sequence and
    sees every committed key plus new keys allowed by ``tree_mask`` [B, Q, Q] (causal when None).
    ``depths`` [B, Q] overrides the position offsets (tree nodes share positions by depth).
    """
    tokens = torch.from_numpy(plan.token_ids).long()
    q_lens = torch.from_numpy(plan.q_lens).long()
    cached = torch.from_numpy(plan.cached_lens).long()
    pages = torch.from_numpy(plan.page_table).long()
    batch, queries = tokens.shape
    total = cached + q_lens
    span = int(total.max()) if batch else 1
    span = -(-span // page_size) * page_size

    j = torch.arange(queries)
    real_q = j[None, :] < q_lens[:, None]  # [B, Q]
    offsets = depths.long() if depths is not None else j[None, :].expand(batch, queries)
    positions = torch.where(real_q, cached[:, None] + offsets, 0)
    write_slots = torch.where(real_q, _slots(pages, cached[:, None] + j[None, :], page_size), 0)

    t = torch.arange(span)
    real_t = t[None, :] < total[:, None]  # [B, T]
    read_slots = torch.where(real_t, _slots(pages, t[None, :].expand(batch, span), page_size), 0)

    q_index = cached[:, None] + j[None, :]  # logical index of each query [B, Q]
    mask = (t[None, None, :] <= q_index[:, :, None]) & real_t[:, None, :]
    if tree_mask is not None:
        new = t[None, None, :] >= cached[:, None, None]  # keys written this step
        rel = (t[None, None, :] - cached[:, None, None]).clamp(0, queries - 1)
        allowed = torch.gather(tree_mask.bool(), 2, rel.expand(batch, queries, span))
        mask &= ~new | allowed
    if sliding_window:
        key_pos = t[None, None, :]
        mask &= key_pos > q_index[:, :, None] - sliding_window
    mask &= real_q[:, :, None]
    # Padded query rows attend to the dummy slot only, so softmax never sees an all -inf row.
    mask[:, :, 0] |= ~real_q
    fb = ForwardBatch(tokens, positions, write_slots, read_slots, mask[:, None])
    return fb if device.type == "cpu" else fb.to(device)


def _slots(pages: torch.Tensor, logical: torch.Tensor, page_size: int) -> torch.Tensor:
    page_idx = (logical // page_size).clamp(max=pages.shape[1] - 1)
    return torch.gather(pages, 1, page_idx) * page_size + logical % page_size
