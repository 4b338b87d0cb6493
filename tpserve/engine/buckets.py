"""Batch-size buckets for captured (CUDA graph) and compiled (torch.compile) forwards, and the
key spans CUDA graphs of gathering forwards are captured at (``key_spans``).

A captured or compiled forward runs at the batch sizes it was built for, so a batch of b
requests (each feeding the same Q rows) is padded up to the next bucket B with inert
requests: each feeds token 0 at position 0, has Q keys of its own on the dummy page 0
(slots 0..Q-1 modulo the page size) and attends only to them, so its softmax is finite and no
real slot is touched. Attention work follows each request's own key count and the page table
is read in place, so nothing is padded along the context: real rows attend exactly as in the
unpadded batch; only floating-point blocking inside matmul kernels may differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.layers.attention.metadata import AttentionMetadata, HostLayout, build_metadata


@dataclass(frozen=True)
class Buckets:
    batch_sizes: tuple[int, ...]  # ascending

    def pick(self, batch: int) -> int | None:
        """Smallest bucket holding ``batch`` requests; None when it must run eagerly."""
        return next((s for s in self.batch_sizes if s >= batch), None)


def default_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """SGLang-like: dense at small sizes (where padding waste matters most), then every 8/16/32."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 513, 16), *range(544, 4097, 32)]
    # The largest bucket is max_bs itself: a batch of max_bs must never fall through to eager.
    return tuple(sorted({s for s in sizes if s < max_bs} | {max(1, max_bs)}))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# Key spans: the smallest, and the factor between one span and the next (see key_spans).
FIRST_KEY_SPAN = 4096
KEY_SPAN_FACTOR = 4


def key_spans(max_keys: int, page_size: int, first: int = FIRST_KEY_SPAN,
              factor: int = KEY_SPAN_FACTOR) -> tuple[int, ...]:
    """Ascending static key widths (page multiples) a gathering graph is captured at, the last
    ``max_keys``: a replay then gathers at most ``factor`` x its longest request's keys (or
    ``first``), not the context limit's worth, for log_factor(max_keys / first) more graphs."""
    spans, span = [], first
    while span < max_keys:
        spans.append(round_up(span, page_size))
        span *= factor
    return (*sorted(set(spans)), max_keys)


def graph_spans(batch_sizes: tuple[int, ...], spans: tuple[int, ...],
                gather_tokens: int | None) -> dict[int, tuple[int, ...]]:
    """The key spans a gathering forward is captured at, per batch bucket: the narrowest
    always, wider ones while bucket x span stays within ``gather_tokens`` (None: all). A
    graph's gather is reserved memory for the server's life, so a batch that is both large
    and long runs eagerly instead of every rank keeping its buffers at start-up."""
    return {bs: tuple(k for i, k in enumerate(spans)
                      if i == 0 or gather_tokens is None or bs * k <= gather_tokens)
            for bs in batch_sizes}


def _pad(t: torch.Tensor, rows: int, value: int = 0) -> torch.Tensor:
    """``t`` with ``rows`` more rows of ``value`` (dim 0)."""
    if rows == 0:
        return t
    return torch.cat([t, t.new_full((rows, *t.shape[1:]), value)])


def _pad_host(host: HostLayout, extra: int, queries: int) -> HostLayout:
    last = int(host.q_indptr[-1])
    indptr = np.concatenate([host.q_indptr, last + queries * np.arange(1, extra + 1)])
    table = np.concatenate([host.page_table, np.zeros((extra, host.page_table.shape[1]),
                                                      dtype=host.page_table.dtype)])
    start = None if host.mask_start is None else np.concatenate(
        [host.mask_start, np.zeros(extra, dtype=host.mask_start.dtype)])
    return HostLayout(indptr.astype(np.int32),
                      np.concatenate([host.kv_lens, np.full(extra, queries)]).astype(np.int32),
                      table, start)


def pad_metadata(meta: AttentionMetadata, batch: int, queries: int) -> AttentionMetadata:
    """``meta`` of b requests with Q rows each, padded to ``batch`` requests (inert ones)."""
    extra = batch - meta.batch_size
    if extra == 0:
        return meta
    if extra < 0:
        raise ValueError(f"bucket {batch} is smaller than the batch ({meta.batch_size})")
    ps = meta.page_size
    slots = torch.arange(queries, device=meta.write_slots.device) % ps
    indptr = meta.q_indptr[-1] + queries * torch.arange(1, extra + 1, device=meta.q_indptr.device,
                                                       dtype=meta.q_indptr.dtype)
    mask = meta.custom_mask
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones((extra, *mask.shape[1:]))])
    return dataclasses.replace(
        meta, page_table=_pad(meta.page_table, extra), kv_lens=_pad(meta.kv_lens, extra, queries),
        q_indptr=torch.cat([meta.q_indptr, indptr]),
        write_slots=torch.cat([meta.write_slots, slots.repeat(extra)]),
        max_kv_len=max(meta.max_kv_len, queries), host=_pad_host(meta.host, extra, queries),
        mask_start=None if meta.mask_start is None else _pad(meta.mask_start, extra),
        custom_mask=mask)


def pad_forward_batch(fb: ForwardBatch, batch: int) -> ForwardBatch:
    """Pad a uniform ``fb`` (Q rows per request) to ``batch`` requests with inert ones."""
    if fb.batch_size == batch:
        return fb
    if batch < fb.batch_size:
        raise ValueError(f"bucket {batch} is smaller than the batch ({fb.batch_size})")
    rows = (batch - fb.batch_size) * fb.queries
    return ForwardBatch(_pad(fb.input_ids, rows), _pad(fb.positions, rows),
                        pad_metadata(fb.attn, batch, fb.queries), fb.queries)


def inert_batch(batch: int, queries: int, pages: int, page_size: int, device: torch.device,
                masked_keys: int = 0) -> ForwardBatch:
    """A batch of only inert requests (a page table ``pages`` wide); with ``masked_keys`` > 0 it
    carries a speculative mask of that width, like draft and verify steps."""
    table = np.zeros((batch, max(1, pages)), dtype=np.int32)
    q = np.full(batch, queries, dtype=np.int32)
    mask_start = mask = None
    if masked_keys:
        mask_start = np.zeros(batch, dtype=np.int32)
        mask = torch.ones(batch, queries, masked_keys, dtype=torch.bool)
    meta = build_metadata(table, q, q, page_size, device, mask_start=mask_start, custom_mask=mask)
    zeros = torch.zeros(batch * queries, dtype=torch.long, device=device)
    return ForwardBatch(zeros, zeros.clone(), meta, queries)


def pad_rows(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``tensor`` to ``batch`` rows (per-request extra inputs)."""
    return _pad(tensor, batch - tensor.shape[0])
