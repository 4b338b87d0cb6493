"""A plan's arrays kept from one step to the next: the [B, P] page table, the counts.

Rank 0 plans every step on its critical path, and rebuilt the page table from each request's
page list every time: a list of Python ints into numpy, row by row. Measured with the caches
emptied first (as the step's weight stream leaves them), ``Scheduler.plan`` took 68 us at
batch 1 (384 tokens), 236 us at batch 16 with 8K-token contexts and 309 us at batch 64 with
2K ones, most of it this conversion and a handful of small numpy calls. Between two decode
steps of the same requests the table is the same unless a request took a page, so it is
kept: unchanged it is returned as is (the same array, which the plain guess then compares by
identity), and when requests took pages only their new entries are written, into a copy.
The same goes for the per-request counts, equal from one decode step to the next.

Which rows can be kept is decided by the page lists themselves: the scheduler only ever
extends a request's list in place or replaces it with a new list (``Scheduler.reserve``,
``_release_pages``, ``_reuse_prefix``), so a row whose list is the same object, no shorter,
holds the same leading pages. The kept lists are referenced here, so while they are compared
against, no other list can have their identity.

Returned arrays are shared between the steps that get them, so nobody may write to them
(nothing does: plans are read, encoded and compared).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PlanCache:
    """The arrays of the last plan asked for, reused where the next is the same."""

    def __init__(self) -> None:
        self._lists: tuple[list[int], ...] = ()
        self._lens: tuple[int, ...] = ()
        self._table: np.ndarray | None = None
        self._counts: tuple[tuple[int, ...], tuple[bool, ...]] | None = None
        self._count_arrays: tuple[np.ndarray, np.ndarray] | None = None

    def page_table(self, page_lists: Sequence[list[int]]) -> np.ndarray:
        """[len(page_lists), longest list] int32, each row its list's pages then zeros."""
        lens = tuple(len(pages) for pages in page_lists)
        old, width = self._table, max(lens, default=0)
        if (old is not None and old.shape[0] == len(lens) and width >= old.shape[1]
                and all(a is b for a, b in zip(page_lists, self._lists, strict=True))
                and all(n >= m for n, m in zip(lens, self._lens, strict=True))):
            table = old if lens == self._lens else self._grown(old, page_lists, lens, width)
        else:
            table = np.zeros((len(lens), width), dtype=np.int32)
            for row, pages in enumerate(page_lists):
                table[row, : len(pages)] = pages
        self._lists, self._lens, self._table = tuple(page_lists), lens, table
        return table

    def _grown(self, old: np.ndarray, page_lists: Sequence[list[int]], lens: tuple[int, ...],
               width: int) -> np.ndarray:
        """``old`` widened to ``width`` with the pages appended since it was built."""
        table = np.zeros((len(lens), width), dtype=np.int32)
        table[:, : old.shape[1]] = old
        for row, (pages, n, m) in enumerate(zip(page_lists, lens, self._lens, strict=True)):
            if n > m:
                table[row, m:n] = pages[m:n]
        return table

    def counts(self, q_lens: Sequence[int], samples: Sequence[bool]
               ) -> tuple[np.ndarray, np.ndarray]:
        """(q_lens as int32, the rows whose logits are sampled as int64: each sampled
        request's last row)."""
        key = (tuple(q_lens), tuple(samples))
        if self._count_arrays is None or key != self._counts:
            ends = np.cumsum(np.asarray(key[0], dtype=np.int64)) - 1
            rows = [int(end) for end, s in zip(ends, key[1], strict=True) if s]
            self._counts = key
            self._count_arrays = (np.array(key[0], dtype=np.int32),
                                  np.array(rows, dtype=np.int64))
        return self._count_arrays
