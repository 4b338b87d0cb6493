"""When a tree grown ahead (``Drafter.run_ahead``) may stand in for the real plan's."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tpserve.engine.messages import SpecStep
from tpserve.engine.plan import plan_fingerprint
from tpserve.spec.drafter import Ahead, Guess, held_pages, moved_slots
from tpserve.spec.tree import DraftTree


def _step(tokens: list[int], lens: list[int], cached: list[int], pages: list[list[int]],
          keys: list[int]) -> SpecStep:
    return SpecStep(np.array(tokens, dtype=np.int64), np.array(lens, dtype=np.int32),
                    np.array(cached, dtype=np.int32), np.array(pages, dtype=np.int32),
                    np.array(keys, dtype=np.int64), np.zeros(0, dtype=np.int64), True)


def _ahead(layout: object = None) -> Ahead:
    guess = _step([5, 6, 7, 9], [3, 1], [40, 18], [[3, 4, 8], [1, 2, 0]], [11, 12])
    tree = DraftTree(*(torch.zeros(2, 4, dtype=torch.long) for _ in range(3)),
                     torch.zeros(2, 4, 4, dtype=torch.bool))
    # Request 0's draft went into its first 3 pages, request 1's into its first 2; the verify
    # layout reads request 0's first 3 pages and request 1's first 1.
    return Ahead(guess, [[0, 1, 2], [0]], np.array([3, 2]), tree,  # type: ignore[arg-type]
                 layout, np.array([3, 1]))


def _each_field_changed(g: SpecStep) -> tuple[SpecStep, ...]:
    """The plan ``g`` with one of its tokens, counts, lengths or keys changed."""
    return (dataclasses.replace(g, token_ids=np.array([5, 6, 8, 9], dtype=np.int64)),
            dataclasses.replace(g, q_lens=np.array([2, 2], dtype=np.int32)),
            dataclasses.replace(g, cached_lens=np.array([41, 18], dtype=np.int32)),
            dataclasses.replace(g, keys=np.array([12, 11], dtype=np.int64)))


def test_the_assumed_plan_fits() -> None:
    ahead = _ahead(layout=object())
    assert ahead.fits(ahead.step) and ahead.layout_fits(ahead.step)
    assert not _ahead().layout_fits(ahead.step)  # no layout was built ahead


def test_pages_beyond_the_drafts_reach_do_not_matter() -> None:
    """Neither to the tree nor to the verify layout: a page the scheduler added for later
    steps is read by neither."""
    ahead = _ahead(layout=object())
    wider = dataclasses.replace(ahead.step, page_table=np.array([[3, 4, 8, 9], [1, 2, 5, 0]],
                                                                dtype=np.int32))
    assert ahead.fits(wider) and ahead.layout_fits(wider)
    pad = dataclasses.replace(ahead.step, page_table=np.array([[3, 4, 8], [1, 2, 7]],
                                                              dtype=np.int32))
    assert ahead.fits(pad) and ahead.layout_fits(pad)  # request 1's third entry
    # Request 1's second page: where its draft went, not where its verify goes.
    other = dataclasses.replace(ahead.step, page_table=np.array([[3, 4, 8], [1, 6, 0]],
                                                                dtype=np.int32))
    assert not ahead.fits(other)
    ahead_only_layout = dataclasses.replace(ahead, pages=np.array([3, 1]))
    assert ahead_only_layout.fits(other) and ahead_only_layout.layout_fits(other)
    moved = dataclasses.replace(ahead.step, page_table=np.array([[3, 5, 8], [1, 2, 0]],
                                                                dtype=np.int32))
    assert not ahead.layout_fits(moved)


def test_held_pages_count_each_rows_own_entries() -> None:
    """Rows of a batch's page table are padded with the dummy page 0."""
    assert held_pages(np.array([[3, 4, 8], [1, 2, 0], [7, 0, 0]], dtype=np.int32)) == [3, 2, 1]


def test_any_difference_the_draft_saw_voids_it() -> None:
    ahead, g = _ahead(), _ahead().step
    moved = np.array([[3, 4, 8], [1, 6, 0]], dtype=np.int32)  # a page the draft wrote
    narrow = np.array([[3, 4], [1, 2]], dtype=np.int32)
    for real in (dataclasses.replace(g, page_table=moved),
                 dataclasses.replace(g, page_table=narrow), *_each_field_changed(g)):
        assert not ahead.fits(real)
    # A request dropped from the batch (it finished): another plan altogether.
    one = _step([5, 6, 7], [3], [40], [[3, 4, 8]], [11])
    assert not ahead.fits(one)


def test_a_dtype_difference_alone_still_fits() -> None:
    """The byte compare falls back to comparing values when the dtypes differ."""
    ahead, step = _ahead(), _ahead().step
    assert ahead.fits(dataclasses.replace(step, token_ids=step.token_ids.astype(np.int32)))
    assert not ahead.fits(dataclasses.replace(step, keys=step.keys[::-1].copy()))


def test_moved_slots_compact_each_path_onto_consecutive_slots() -> None:
    """Applying the moves (every source read before any write, as ``move_slots`` does) leaves
    node ``path[i]``'s entry at logical index committed + i of its request, across pages,
    and leaves every other request's and every earlier entry alone."""
    page_size, paths, committed = 4, [[0, 2, 5, 6], [0, 1, 2], [0, 3], [0]], [9, 2, 14, 5]
    pages = np.array([[7, 1, 4, 9, 2], [3, 8, 0, 0, 0], [5, 6, 10, 11, 12], [13, 0, 0, 0, 0]])
    cache = np.arange(14 * page_size) * 10  # slot s holds 10 * s

    def slot(b: int, logical: int) -> int:
        return int(pages[b, logical // page_size]) * page_size + logical % page_size

    before = cache.copy()
    moves = moved_slots(pages, committed, paths, page_size)
    assert moves is not None
    src, dst = moves
    cache[dst] = before[src]
    for b, path in enumerate(paths):
        for i, node in enumerate(path):
            assert cache[slot(b, committed[b] + i)] == before[slot(b, committed[b] + node)]
        for logical in range(committed[b] + 1):
            assert cache[slot(b, logical)] == before[slot(b, logical)]
    assert moved_slots(pages, committed, [[0, 1, 2], [0, 1], [0], [0]], page_size) is None


def test_only_the_exact_plan_is_the_guess() -> None:
    """Rank 0 says "as guessed" only for a plan equal to the guess in every field but the
    page table (which then travels along, and the follower checks it as for any plan): a
    dropped key, say, makes it send the whole plan."""
    guess = Guess(_ahead().step, [[0, 1, 2], [0]], [43, 19], [3, 2], [3, 2])
    g = guess.step
    same = _step([5, 6, 7, 9], [3, 1], [40, 18], [[3, 4, 8], [1, 2, 0]], [11, 12])
    assert guess.is_plan(same) and guess.same_pages(same)
    assert guess.fingerprint() == plan_fingerprint(same)
    paged = dataclasses.replace(g, page_table=np.array([[3, 4, 8], [1, 2, 7]], dtype=np.int32))
    assert guess.is_plan(paged) and not guess.same_pages(paged)
    for real in (dataclasses.replace(g, drop=np.array([3], dtype=np.int64)),
                 dataclasses.replace(g, greedy=False), *_each_field_changed(g)):
        assert not guess.is_plan(real)
    # The fingerprint a follower checks tells other tokens or counts apart.
    other = dataclasses.replace(g, token_ids=np.array([5, 6, 7, 8], dtype=np.int64))
    assert plan_fingerprint(other) != guess.fingerprint()
    split = dataclasses.replace(g, q_lens=np.array([2, 2], dtype=np.int32))
    assert plan_fingerprint(split) != guess.fingerprint()
