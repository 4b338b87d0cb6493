"""The plain step a follower works out itself (``plain_guess``) and how it waits for rank 0's
word on it (``follower.Confirm``)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tpserve.engine.follower import Confirm
from tpserve.engine.messages import AsGuessed, ConfigChange, DraftFeed, ForwardStep, encode
from tpserve.engine.plain_guess import GuessMissed, as_guessed, follows_as_guessed, next_step
from tpserve.engine.plan import same_array

PAGE = 4


def is_guess(plan: ForwardStep, guess: ForwardStep) -> bool:
    """The reference rank 0's list test stands for: ``plan`` is ``guess``, every field."""
    return (plan.greedy == guess.greedy and plan.feed is None and guess.feed is None
            and same_array(plan.token_ids, guess.token_ids)
            and same_array(plan.q_lens, guess.q_lens)
            and same_array(plan.cached_lens, guess.cached_lens)
            and same_array(plan.page_table, guess.page_table)
            and same_array(plan.logit_rows, guess.logit_rows))


def decode_step(cached: list[int], pages: list[list[int]]) -> ForwardStep:
    width = max(len(p) for p in pages)
    table = np.array([p + [0] * (width - len(p)) for p in pages], dtype=np.int32)
    n = len(cached)
    return ForwardStep(token_ids=np.arange(5, 5 + n, dtype=np.int64),
                       q_lens=np.ones(n, dtype=np.int32),
                       cached_lens=np.array(cached, dtype=np.int32), page_table=table,
                       logit_rows=np.arange(n, dtype=np.int64), greedy=True)


def test_the_next_step_feeds_each_pick_on_the_pages_held() -> None:
    step = decode_step([5, 9], [[3, 7], [4, 8, 9]])
    guess = next_step(step, [11, 12], PAGE)
    assert guess is not None
    assert guess.token_ids.tolist() == [11, 12] and guess.q_lens.tolist() == [1, 1]
    assert guess.cached_lens.tolist() == [6, 10]
    assert guess.page_table is step.page_table and guess.logit_rows.tolist() == [0, 1]
    assert guess.greedy and guess.feed is None
    assert is_guess(replace(guess), guess)
    assert follows_as_guessed(replace(guess), step, [11, 12])


def test_a_prompt_chunk_that_sampled_leads_to_its_first_decode_step() -> None:
    step = replace(decode_step([0], [[3, 7]]), token_ids=np.arange(6, dtype=np.int64),
                   q_lens=np.array([6], dtype=np.int32), logit_rows=np.array([5]))
    guess = next_step(step, [9], PAGE)
    assert guess is not None and guess.cached_lens.tolist() == [6]


@pytest.mark.parametrize("why", ["new page", "not greedy", "fed", "not sampled", "empty"])
def test_no_guess_where_a_follower_cannot_know_the_step(why: str) -> None:
    step, tokens = decode_step([5, 9], [[3, 7], [4, 8, 9]]), [11, 12]
    if why == "new page":
        step = decode_step([5, 7], [[3, 7], [4, 8]])  # the second's 9th token needs page 3
    elif why == "not greedy":
        step = replace(step, greedy=False)
    elif why == "fed":
        none = np.zeros(0, dtype=np.int64)
        step = replace(step, feed=DraftFeed(none.astype(np.int32), none, none, none,
                                            none.astype(np.int32), none.astype(bool)))
    elif why == "not sampled":  # the second request was mid-prompt
        step, tokens = replace(step, logit_rows=np.array([0])), [11]
    else:
        tokens = []
        step = replace(step, token_ids=step.token_ids[:0], q_lens=step.q_lens[:0],
                       cached_lens=step.cached_lens[:0], page_table=step.page_table[:0],
                       logit_rows=step.logit_rows[:0])
    assert next_step(step, tokens, PAGE) is None


@pytest.mark.parametrize("field", ["token_ids", "cached_lens", "page_table", "logit_rows",
                                   "greedy", "requests"])
def test_a_plan_that_differs_anywhere_is_not_the_guess(field: str) -> None:
    prev = decode_step([5, 9], [[3, 7], [4, 8, 9]])
    guess = next_step(prev, [11, 12], PAGE)
    assert guess is not None
    changed = {
        "token_ids": lambda: replace(guess, token_ids=np.array([11, 13])),
        "cached_lens": lambda: replace(guess, cached_lens=np.array([6, 11], dtype=np.int32)),
        "page_table": lambda: replace(guess, page_table=np.array([[3, 7, 2], [4, 8, 9]],
                                                                 dtype=np.int32)),
        "logit_rows": lambda: replace(guess, logit_rows=np.array([1, 0])),
        "greedy": lambda: replace(guess, greedy=False),
        "requests": lambda: next_step(decode_step([5], [[3, 7]]), [11], PAGE),
    }[field]()
    assert not is_guess(changed, guess)
    assert not follows_as_guessed(changed, prev, [11, 12])


class Channel:
    def __init__(self, *msgs: Any) -> None:
        self.msgs = [encode(m) for m in msgs]

    def recv(self) -> bytes:
        return self.msgs.pop(0)

    def send(self, obj: Any) -> None:
        raise AssertionError("a follower never sends")


def comm_with(stats: SimpleNamespace) -> Any:
    return SimpleNamespace(active=SimpleNamespace(stats=stats))


def test_confirmation_goes_on_misses_or_fails_loudly() -> None:
    guess = next_step(decode_step([5], [[3, 7]]), [11], PAGE)
    assert guess is not None
    Confirm(Channel(as_guessed(guess)), guess, None)()  # confirmed: returns
    other = ConfigChange(allreduce="gloo")
    with pytest.raises(GuessMissed) as missed:
        Confirm(Channel(other), guess, None)()
    assert missed.value.msg == other
    with pytest.raises(RuntimeError, match="guessed otherwise"):
        Confirm(Channel(AsGuessed(as_guessed(guess).fingerprint + 1)), guess, None)()
    stats = SimpleNamespace(calls=3)
    late = Confirm(Channel(as_guessed(guess)), guess, comm_with(stats))
    stats.calls += 1  # a collective ran before the confirmation
    with pytest.raises(RuntimeError, match="before rank 0 confirmed"):
        late()


def test_rank_0s_test_on_lists_agrees_with_the_followers_guess() -> None:
    """``follows_as_guessed`` (rank 0) says yes exactly where ``is_guess(plan, next_step(...))``
    (what every follower checks against) does, over valid plans of every kind of change."""
    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for _ in range(300):
        n = int(rng.integers(1, 4))
        cached = rng.integers(1, 12, n).tolist()
        pages = [list(range(10 * b + 1, 10 * b + 2 + (c - 1) // PAGE))
                 for b, c in enumerate(cached)]
        prev = replace(decode_step([c - 1 for c in cached], pages), greedy=bool(rng.random() < 0.9))
        tokens = rng.integers(0, 50, n).tolist()
        cur = [c + 1 for c in cached]  # after the next step
        need = [list(p) + ([99 + b] if c > len(p) * PAGE else []) for b, (p, c) in
                enumerate(zip(pages, cur, strict=True))]
        plan = replace(decode_step(cached, need), token_ids=np.array(tokens, dtype=np.int64))
        change = rng.integers(0, 4)
        if change == 1:
            plan = replace(plan, token_ids=plan.token_ids + 1)
        elif change == 2 and n > 1:
            plan = replace(plan, token_ids=plan.token_ids[1:], q_lens=plan.q_lens[1:],
                           cached_lens=plan.cached_lens[1:], page_table=plan.page_table[1:],
                           logit_rows=plan.logit_rows[:-1])
        elif change == 3:
            plan = replace(plan, greedy=False)
        guess = next_step(prev, tokens, PAGE)
        want = guess is not None and is_guess(plan, guess)
        assert follows_as_guessed(plan, prev, tokens) == want
        seen[want] += 1
    assert min(seen.values()) > 30  # both answers, many times
