"""PlanCache: the page table and counts it hands out equal a fresh build at every step, the
same array comes back while nothing changed, and an array handed out is never written to
afterwards (steps share them)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tpserve.engine.plan_cache import PlanCache


def fresh_table(page_lists: list[list[int]]) -> np.ndarray:
    table = np.zeros((len(page_lists), max(map(len, page_lists))), dtype=np.int32)
    for row, pages in enumerate(page_lists):
        table[row, : len(pages)] = pages
    return table


def fresh_counts(q_lens: list[int], samples: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(q_lens) - 1
    return (np.array(q_lens, dtype=np.int32),
            np.array([e for e, s in zip(ends, samples) if s], dtype=np.int64))


@pytest.mark.parametrize("seed", range(6))
def test_page_tables_equal_a_fresh_build_as_requests_come_grow_and_go(seed: int) -> None:
    rng = random.Random(seed)
    next_page = iter(range(1, 10**6))
    live = [[next(next_page) for _ in range(rng.randint(1, 5))] for _ in range(3)]
    cache, handed = PlanCache(), []
    for _ in range(400):
        event = rng.random()
        if event < 0.5:  # decode: a few requests take a page, in place (Scheduler.reserve)
            for pages in live:
                if rng.random() < 0.2:
                    pages.extend(next(next_page) for _ in range(rng.randint(1, 2)))
        elif event < 0.6 and len(live) > 1:  # one finishes
            live.pop(rng.randrange(len(live)))
        elif event < 0.7:  # one joins
            live.insert(rng.randrange(len(live) + 1), [next(next_page)])
        elif event < 0.8:  # preempted and readmitted: a new list, maybe as long as the old
            i = rng.randrange(len(live))
            live[i] = [next(next_page) for _ in range(len(live[i]))]
        elif event < 0.85:  # the batch in another order
            rng.shuffle(live)
        before = [(t, t.copy()) for t in handed[-5:]]
        table = cache.page_table(live)
        assert table.dtype == np.int32
        np.testing.assert_array_equal(table, fresh_table(live))
        if event >= 0.85 and handed:  # nothing changed since the last step
            assert table is handed[-1]
        for old, copy in before:  # a step's table stays what it was
            np.testing.assert_array_equal(old, copy)
        handed.append(table)


def test_an_unchanged_batch_gets_the_same_table_and_a_grown_one_a_new_one() -> None:
    a, b = [3, 4], [7]
    cache = PlanCache()
    first = cache.page_table([a, b])
    assert cache.page_table([a, b]) is first
    b.append(9)  # b takes a page: a wider table, first untouched
    grown = cache.page_table([a, b])
    assert grown is not first and grown.tolist() == [[3, 4], [7, 9]]
    assert first.tolist() == [[3, 4], [7, 0]]
    same_len = [5, 6]  # a replaced by a new list of the same length
    assert cache.page_table([same_len, b]).tolist() == [[5, 6], [7, 9]]


@pytest.mark.parametrize("seed", range(3))
def test_counts_equal_a_fresh_build(seed: int) -> None:
    rng = random.Random(seed)
    cache = PlanCache()
    last = None
    for _ in range(200):
        if last is None or rng.random() < 0.3:
            batch = rng.randint(1, 6)
            q_lens = [rng.choice([1, 1, 1, 4, 17]) for _ in range(batch)]
            samples = [rng.random() < 0.8 for _ in range(batch)]
        got = cache.counts(q_lens, samples)
        want = fresh_counts(q_lens, samples)
        assert got[0].dtype == np.int32 and got[1].dtype == np.int64
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        if last is not None and last[0] == (q_lens, samples):
            assert got[0] is last[1][0] and got[1] is last[1][1]
        last = ((list(q_lens), list(samples)), got)
