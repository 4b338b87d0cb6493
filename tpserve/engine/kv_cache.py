"""Paged KV cache storage (every rank) and the page allocator (rank 0's scheduler).

Storage is one flat slot array per layer; slot = page * page_size + offset. Page 0 is never
handed out: padded queries write there and padded keys read from there, so rectangular
batches need no data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheConfig:
    num_pages: int
    page_size: int
    num_layers: int
    kv_heads: int  # per rank
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    @staticmethod
    def pages_for_budget(budget_bytes: int, page_size: int, num_layers: int, kv_heads: int,
                         head_dim: int, dtype: torch.dtype) -> int:
        per_page = 2 * num_layers * kv_heads * head_dim * dtype.itemsize * page_size
        return max(2, budget_bytes // per_page)


class KVCache:
    def __init__(self, cfg: KVCacheConfig, device: torch.device) -> None:
        self.cfg = cfg
        slots = cfg.num_pages * cfg.page_size
        shape = (slots, cfg.kv_heads, cfg.head_dim)
        # zeros, not empty: the dummy page must hold finite values (0 * NaN would poison SDPA),
        # and large zeroed CPU allocations are lazily backed by the OS anyway.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=cfg.dtype, device=device),
             torch.zeros(shape, dtype=cfg.dtype, device=device))
            for _ in range(cfg.num_layers)
        ]

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KV entries slot-wise (used to compact accepted speculative tokens)."""
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]


class PageAllocator:
    """Free-list of pages; page 0 is reserved as the dummy page."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
