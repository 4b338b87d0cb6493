"""The per-step attention metadata: a ragged batch over the paged KV cache, built once per step.

Request b owns query rows ``q_indptr[b]:q_indptr[b + 1]`` of q (decode tokens and prefill
chunks mix without padding) and ``kv_lens[b]`` keys after this step's write (cached + new);
its new tokens are the last ``q_len`` of them, so query j sits at logical index
``kv_lens[b] - q_len + j`` and is written to slot ``page * page_size + offset`` of that index.
Without a custom mask attention is causal by logical index. With one (speculative steps), keys
below ``mask_start[b]`` are visible to every query of b, keys in
``[mask_start, mask_start + M)`` per ``custom_mask[b, j, key - mask_start]``, later keys to
none. A sliding window (the backend's spec) hides keys at or below ``query - window``.
``mask_is_causal`` says a mask is causal by construction (a chain's verify: its block is the
query block itself, and node j's ancestors are nodes 0 .. j - 1), so a backend whose kernel
only runs causally (FlashInfer's MLA) may read it as no mask; others keep using the mask.

Everything here is O(batch + query rows) on top of the page table itself: nothing grows with
context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ArrayLike = np.ndarray | torch.Tensor


@dataclass(frozen=True)
class HostLayout:
    """CPU copies of the small vectors, for backends that plan on the host (FlashInfer)."""

    q_indptr: np.ndarray  # [B + 1] int32
    kv_lens: np.ndarray  # [B] int32
    page_table: np.ndarray  # [B, P] int32
    mask_start: np.ndarray | None  # [B] int32


@dataclass(frozen=True)
class AttentionMetadata:
    page_table: torch.Tensor  # [B, P] int32 page ids; page 0 is the dummy page
    q_indptr: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32, keys readable after this step's write
    write_slots: torch.Tensor  # [N] int64, cache slot of each query row's new key/value
    page_size: int
    max_q_len: int
    max_kv_len: int
    host: HostLayout
    mask_start: torch.Tensor | None = None  # [B] int32
    custom_mask: torch.Tensor | None = None  # [B, max_q_len or more, M] bool
    uniform_q_len: int = 0  # Q when every request has Q > 0 rows (a plain int: no tracing)
    mask_is_causal: bool = False  # custom_mask is the query block's causal mask (a chain)

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.write_slots.shape[0])

    @property
    def is_decode(self) -> bool:
        """One query per request and a plain causal mask."""
        return self.max_q_len <= 1 and self.custom_mask is None

    @property
    def is_plain_decode(self) -> bool:
        """``is_decode`` with exactly one row for every request (what graph-mode decode
        kernels take: their query offsets are 0..B)."""
        return self.is_decode and self.num_rows == self.batch_size


def _int32(x: ArrayLike) -> np.ndarray:
    if isinstance(x, np.ndarray) and x.dtype == np.int32 and x.flags.c_contiguous:
        return x
    arr = x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return np.ascontiguousarray(arr, dtype=np.int32)


def write_slots_for(page_table: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
                    page_size: int) -> np.ndarray:
    """Slots of each request's last ``q_len`` logical indices, request-major: [sum q_lens]."""
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    starts = np.cumsum(q_lens) - q_lens
    logical = (kv_lens - q_lens)[rows] + np.arange(len(rows)) - starts[rows]
    pages = page_table[rows, logical // page_size].astype(np.int64)
    return pages * page_size + logical % page_size


# Below this many rows, index arithmetic on Python ints beats numpy's per-call overhead
# (~1-2 us an op on a small array; a speculative step builds several layouts per step).
SMALL_ROWS = 64


def _small_write_slots(page_table: np.ndarray, q_lens: list[int], kv_lens: list[int],
                       page_size: int) -> np.ndarray:
    """``write_slots_for`` on Python ints, for a few rows (reading only the pages written)."""
    slots: list[int] = []
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q:
            first = (kv - q) // page_size
            row = page_table[b, first : (kv - 1) // page_size + 1].tolist()
            slots.extend(row[i // page_size - first] * page_size + i % page_size
                         for i in range(kv - q, kv))
    return np.array(slots, dtype=np.int64)


@dataclass(frozen=True)
class _Extents:
    """What the checks learn on the way: the query and key counts as Python ints, the
    largest of each, and the common query count (0 when they differ or some request has
    none)."""

    q: list[int]
    kv: list[int]
    max_q: int
    max_kv: int
    uniform_q: int


def _check(page_table: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray, page_size: int,
           mask_start: np.ndarray | None, custom_mask: torch.Tensor | None) -> _Extents:
    batch = (page_table.shape[0],) if page_table.ndim == 2 else None
    if batch is None or q_lens.shape != batch or kv_lens.shape != batch:
        raise ValueError(f"page_table {page_table.shape}, q_lens {q_lens.shape} and kv_lens "
                         f"{kv_lens.shape} must agree on the batch size")
    if (mask_start is None) != (custom_mask is None):
        raise ValueError("mask_start and custom_mask go together")
    if not len(q_lens):
        return _Extents([], [], 0, 0, 0)
    q, kv = q_lens.tolist(), kv_lens.tolist()
    min_q, max_q, max_kv = min(q), max(q), max(kv)
    if min_q < 0 or any(a > b for a, b in zip(q, kv, strict=True)):
        raise ValueError("every request needs 0 <= q_len <= kv_len")
    if -(-max_kv // page_size) > page_table.shape[1]:
        raise ValueError("a request has more keys than its page table covers")
    if custom_mask is not None:
        shape = tuple(custom_mask.shape)
        if len(shape) != 3 or shape[0] != len(q_lens) or shape[1] < max_q:
            raise ValueError(f"custom_mask {shape} must be [batch, >= max q_len, M]")
    return _Extents(q, kv, max_q, max_kv, max_q if min_q == max_q else 0)


def build_metadata(page_table: ArrayLike, q_lens: ArrayLike, kv_lens: ArrayLike, page_size: int,
                   device: torch.device, mask_start: ArrayLike | None = None,
                   custom_mask: torch.Tensor | None = None,
                   mask_is_causal: bool = False) -> AttentionMetadata:
    """Once per step, from host data: ``page_table`` [B, P] page ids, ``q_lens`` [B] new tokens
    per request, ``kv_lens`` [B] keys after the write; for speculative steps ``mask_start`` [B]
    and ``custom_mask`` [B, Qmax, M] bool, and ``mask_is_causal`` where that mask is the
    query block's causal one (see the module docstring)."""
    pages, q, kv = _int32(page_table), _int32(q_lens), _int32(kv_lens)
    start = None if mask_start is None else _int32(mask_start)
    ext = _check(pages, q, kv, page_size, start, custom_mask)
    if mask_is_causal and (start is None or not np.array_equal(start, kv - q)):
        raise ValueError("mask_is_causal needs a mask whose block is the query block "
                         "(mask_start = kv_len - q_len)")
    if ext.uniform_q:
        indptr = np.arange(0, (len(q) + 1) * ext.uniform_q, ext.uniform_q, dtype=np.int32)
    else:
        indptr = np.zeros(len(q) + 1, dtype=np.int32)
        np.cumsum(q, out=indptr[1:])
    slots = (_small_write_slots(pages, ext.q, ext.kv, page_size)
             if max(int(indptr[-1]), len(q)) <= SMALL_ROWS
             else write_slots_for(pages, q, kv, page_size))
    host = HostLayout(indptr, kv, pages, start)
    on_cpu = device.type == "cpu"

    def dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return t if on_cpu else t.to(device, non_blocking=True)

    if custom_mask is not None and (custom_mask.dtype != torch.bool
                                    or custom_mask.device != device
                                    or not custom_mask.is_contiguous()):
        custom_mask = custom_mask.to(device, torch.bool).contiguous()
    return AttentionMetadata(
        page_table=dev(pages), q_indptr=dev(indptr), kv_lens=dev(kv), write_slots=dev(slots),
        page_size=page_size, max_q_len=ext.max_q, max_kv_len=ext.max_kv, host=host,
        mask_start=None if start is None else dev(start), custom_mask=custom_mask,
        uniform_q_len=ext.uniform_q, mask_is_causal=mask_is_causal,
    )
