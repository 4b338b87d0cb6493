"""FlashInfer decode inside CUDA graphs: one fixed-batch wrapper per captured batch bucket.

A ``BatchDecodeWithPagedKVCacheWrapper`` built with ``use_cuda_graph=True`` reads its page layout
from buffers handed over at construction (indptr [B + 1], indices, last_page_len [B]) and keeps
its batch size B. ``plan`` runs on the host before each replay, outside the graph, and copies
that step's layout (O(pages used)) into the buffers, so the captured ``run`` attends over
exactly the pages the step uses: no key span is fixed at capture.

Every bucket's wrapper views one set of buffers: graphs replay one at a time and each replay
is planned just before it. The indices buffer holds B_max * pages-per-request (the width of a
graph's static page table): prefix caching lets requests share pages, so the pool's page count
does not bound the indices. Capture goes largest bucket first, so the first buffers fit every
later bucket; a larger request than they hold gets new buffers (earlier wrappers keep theirs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Builds one graph-mode wrapper from its three buffers (keyword arguments
# paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer).
WrapperFactory = Callable[..., Any]


@dataclass(frozen=True)
class _Buffers:
    indptr: torch.Tensor  # [B_max + 1] int32
    indices: torch.Tensor  # [B_max * pages per request] int32
    last: torch.Tensor  # [B_max] int32

    def fits(self, batch: int, indices: int) -> bool:
        return self.last.numel() >= batch and self.indices.numel() >= indices


@dataclass(frozen=True)
class _Entry:
    wrapper: Any
    indices: int  # page indices its buffers hold


class DecodeGraphWrappers:
    """Graph-mode decode wrappers by batch size, over shared buffers."""

    def __init__(self, make: WrapperFactory, device: torch.device) -> None:
        self._make, self._device = make, device
        self._buffers: _Buffers | None = None
        self._entries: dict[int, _Entry] = {}

    def get(self, batch: int, pages_per_request: int) -> Any:
        """The wrapper for ``batch`` requests of at most ``pages_per_request`` pages each."""
        need = batch * max(1, pages_per_request)
        entry = self._entries.get(batch)
        if entry is not None and entry.indices >= need:
            return entry.wrapper
        buf = self._buffers
        if buf is None or not buf.fits(batch, need):
            buf = self._buffers = self._allocate(batch, need)
        wrapper = self._make(paged_kv_indptr_buffer=buf.indptr[:batch + 1],
                             paged_kv_indices_buffer=buf.indices,
                             paged_kv_last_page_len_buffer=buf.last[:batch])
        self._entries[batch] = _Entry(wrapper, buf.indices.numel())
        return wrapper

    def _allocate(self, batch: int, indices: int) -> _Buffers:
        old = self._buffers
        batch = max(batch, old.last.numel() if old is not None else 0)
        indices = max(indices, old.indices.numel() if old is not None else 0)

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self._device)

        return _Buffers(zeros(batch + 1), zeros(indices), zeros(batch))
