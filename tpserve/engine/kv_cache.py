"""Paged KV cache storage (every rank) and the page allocator (rank 0's scheduler).

Storage is one flat slot array per layer; slot = page * page_size + offset. Page 0 is never
handed out: padded queries write there and padded keys read from there, so rectangular
batches need no data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.errors import ConfigError
from tpserve.layers import cpu_ops
from tpserve.layers.fused import move_slots_reference
from tpserve.layers.huge_pages import NotEnoughMemory, check_available, huge_zeros


@dataclass(frozen=True)
class KVLayout:
    """What one token stores per layer, per rank: a tuple of ``(heads, dim)`` entries.

    Grouped-query attention stores K and V (two ``(kv_heads, head_dim)`` entries); multi-head
    latent attention stores one compressed latent (``(1, kv_lora_rank + qk_rope_head_dim)``),
    which is what makes its cache several times smaller per token.
    """

    num_layers: int
    entries: tuple[tuple[int, int], ...]

    @staticmethod
    def gqa(num_layers: int, kv_heads: int, head_dim: int) -> KVLayout:
        return KVLayout(num_layers, ((kv_heads, head_dim), (kv_heads, head_dim)))

    @staticmethod
    def latent(num_layers: int, dim: int) -> KVLayout:
        return KVLayout(num_layers, ((1, dim),))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * sum(h * d for h, d in self.entries) * dtype.itemsize


@dataclass(frozen=True)
class KVCacheConfig:
    num_pages: int
    page_size: int
    layout: KVLayout
    dtype: torch.dtype

    @staticmethod
    def gqa(num_pages: int, page_size: int, num_layers: int, kv_heads: int, head_dim: int,
            dtype: torch.dtype) -> KVCacheConfig:
        return KVCacheConfig(num_pages, page_size, KVLayout.gqa(num_layers, kv_heads, head_dim),
                             dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.layout.bytes_per_token(self.dtype)

    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds (page 0 is the dummy page)."""
        return (self.num_pages - 1) * self.page_size


class KVCache:
    def __init__(self, cfg: KVCacheConfig, device: torch.device, prefault: bool = False) -> None:
        self.cfg = cfg
        self.prefault = prefault and device.type == "cpu"  # a draft's cache on its pages follows
        slots = cfg.num_pages * cfg.page_size
        if self.prefault:  # all pools at once: refuse before backing any of them
            check_available(slots * cfg.bytes_per_token)
        # One tensor per entry across layers ([layers, slots, heads, dim]); each layer reads a
        # contiguous view of it, and moving slots is one gather/scatter over every layer.
        # zeros, not empty: the dummy page must hold finite values (0 * NaN would poison SDPA),
        # and large zeroed CPU allocations are lazily backed by the OS anyway. On CPU in huge
        # pages, like the weights (layers/huge_pages.py): attention streams the cache too;
        # ``prefault`` backs them now rather than at each 2 MB page's first write.
        self.pools: tuple[torch.Tensor, ...] = tuple(
            huge_zeros((cfg.layout.num_layers, slots, h, d), cfg.dtype, self.prefault)
            if device.type == "cpu" else
            torch.zeros((cfg.layout.num_layers, slots, h, d), dtype=cfg.dtype, device=device)
            for h, d in cfg.layout.entries)
        if device.type == "cpu":
            cpu_ops.load()  # move_slots' op
        self.layers: list[tuple[torch.Tensor, ...]] = [
            tuple(pool[i] for pool in self.pools) for i in range(cfg.layout.num_layers)]

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy KV entries slot-wise in every layer (compacts accepted speculative tokens).

        Every source is read before any destination is written, so ``src`` and ``dst`` may
        overlap (a compacted path shifts its nodes down onto each other's slots). On CPU one
        ``tpserve::move_slots`` call (C++, or its ATen fallback); elsewhere the same gather
        and scatter per pool.
        """
        if self.pools[0].is_cpu:
            torch.ops.tpserve.move_slots(list(self.pools), src, dst)
        else:
            move_slots_reference(list(self.pools), src, dst)


def backed_kv(cfg: KVCacheConfig, device: torch.device, prefault: bool) -> KVCache:
    """The cache; one the OS will not back (``prefault``) stops start-up with the flag to turn."""
    try:
        return KVCache(cfg, device, prefault)
    except NotEnoughMemory as exc:
        raise ConfigError(f"the KV cache does not fit in memory ({exc}); lower --kv-cache-gb",
                          "--kv-cache-gb") from exc


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
