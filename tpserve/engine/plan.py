"""Expanding a step's compact layout (tokens, lengths, page table) into a ForwardBatch.

Messages between ranks carry only integers (``engine/messages.py``); each rank calls
``build_forward_batch`` on what it received, so every rank builds identical tensors. Tokens
are ragged: request b's rows follow request b - 1's, ``q_lens[b]`` of them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.layers.attention.metadata import SMALL_ROWS, build_metadata


class BatchLayout(Protocol):
    """What a forward needs to know about its batch (``ForwardStep`` and ``SpecStep`` have it)."""

    @property
    def token_ids(self) -> np.ndarray: ...  # [N] int64, request by request

    @property
    def q_lens(self) -> np.ndarray: ...  # [B]: tokens fed this step per request

    @property
    def cached_lens(self) -> np.ndarray: ...  # [B]: tokens already in the cache

    @property
    def page_table(self) -> np.ndarray: ...  # [B, P] page ids covering cached + q_len tokens


@dataclass(frozen=True)
class Layout:
    """A batch layout built on a rank itself (draft extend, verify, draft steps), never sent."""

    token_ids: np.ndarray
    q_lens: np.ndarray
    cached_lens: np.ndarray
    page_table: np.ndarray


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal``, as one byte compare where dtype and shape agree (the usual case:
    ~10x cheaper on the plan's small arrays, on a follower's critical path); an array kept
    from the last plan (``PlanCache``) is equal to itself without a look."""
    if a is b:
        return True
    if a.dtype == b.dtype and a.shape == b.shape:
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


def plan_fingerprint(step: BatchLayout) -> int:
    """CRC-32 of a plan's tokens and counts (``Guessed`` and ``AsGuessed`` carry rank 0's)."""
    return zlib.crc32(np.asarray(step.q_lens).tobytes(),
                      zlib.crc32(np.asarray(step.token_ids).tobytes()))


def row_offsets(q_lens: np.ndarray) -> np.ndarray:
    """[N]: each row's index within its request (0 .. q_len - 1)."""
    starts = np.cumsum(q_lens) - q_lens
    return np.arange(int(q_lens.sum())) - np.repeat(starts, q_lens)


def causal_positions(q_lens: np.ndarray, cached: np.ndarray) -> np.ndarray:
    """[N] int64: request b's rows sit at positions cached[b] .. cached[b] + q_lens[b] - 1.
    A few rows (every decode step of a small batch) on Python ints: numpy costs ~1-2 us a
    call on arrays this small, and every rank builds this before each forward."""
    if len(q_lens) <= SMALL_ROWS:
        counts = q_lens.tolist()
        if sum(counts) <= SMALL_ROWS:
            return np.array([c + j for c, n in zip(cached.tolist(), counts, strict=True)
                             for j in range(n)], dtype=np.int64)
    return np.repeat(cached, q_lens) + row_offsets(q_lens)


def build_forward_batch(layout: BatchLayout, page_size: int, device: torch.device,
                        positions: np.ndarray | None = None, mask_start: np.ndarray | None = None,
                        custom_mask: torch.Tensor | None = None) -> ForwardBatch:
    """Expand ``layout`` on this rank.

    Query j of request b is written at logical index cached + j and, without a custom mask,
    sees every key up to itself. ``positions`` [N] overrides the rotary positions (tree nodes
    share positions by depth); ``mask_start`` [B] + ``custom_mask`` [B, Q, M] give speculative
    visibility (see ``AttentionMetadata``).
    """
    q_lens = np.asarray(layout.q_lens, dtype=np.int64)
    cached = np.asarray(layout.cached_lens, dtype=np.int64)
    if positions is None:
        positions = causal_positions(q_lens, cached)
    meta = build_metadata(layout.page_table, q_lens, cached + q_lens, page_size, device,
                          mask_start=mask_start, custom_mask=custom_mask)
    ids = torch.from_numpy(np.ascontiguousarray(layout.token_ids, dtype=np.int64))
    pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
    if device.type != "cpu":
        ids, pos = ids.to(device, non_blocking=True), pos.to(device, non_blocking=True)
    return ForwardBatch(ids, pos, meta, meta.uniform_q_len)
