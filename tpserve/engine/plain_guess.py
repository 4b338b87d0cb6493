"""The plain decode step a follower can work out itself, and prepare before rank 0 confirms it.

At TP > 1 a follower waited for each step's plan, decoded it and only then built the step's
batch (~125 us of Python on caches the weight stream had just emptied) while rank 0, which had
sent it, built its own: on the 2-vCPU Xeon (TP = 2, bench model, batch 1, timestamps on both
ranks) the follower reached the first allreduce ~60 us after rank 0, every step. After a greedy
step every rank holds the same picks (``ForwardOutput.picks``), so when nothing changes (the
same requests, each feeding the token it picked, on the pages it holds) every rank knows the
next step: a follower builds it and waits for rank 0's word only as its forward reaches its
first collective (``HostWork``). Rank 0 sends ``AsGuessed`` instead of the plan when its plan
is that step, field by field, and the plan itself otherwise; the follower then drops what it
built (nothing of it reached the KV cache or a collective) and runs the plan.
"""

from __future__ import annotations

import numpy as np

from tpserve.engine.messages import AsGuessed, ForwardStep, StepMessage
from tpserve.engine.plan import plan_fingerprint, same_array


def next_step(step: ForwardStep, tokens: list[int], page_size: int) -> ForwardStep | None:
    """The step after ``step`` when nothing changes, given its picks ``tokens`` (one per
    request); None where ``step`` leads to none a follower can work out (a request that did
    not sample or needs a page it does not hold yet, or a draft fed: the draft's part of a
    plan is rank 0's to decide)."""
    batch = len(step.q_lens)
    if not step.greedy or step.feed is not None or len(tokens) != batch or batch == 0:
        return None
    cached = (step.cached_lens + step.q_lens).astype(np.int32)
    # Page 0 is the dummy page that pads shorter rows of the table.
    held = np.count_nonzero(step.page_table, axis=1)
    if bool((cached + 1 > held * page_size).any()):
        return None
    return ForwardStep(token_ids=np.array(tokens, dtype=np.int64),
                       q_lens=np.ones(batch, dtype=np.int32), cached_lens=cached,
                       page_table=step.page_table,
                       logit_rows=np.arange(batch, dtype=np.int64), greedy=True)


def follows_as_guessed(plan: ForwardStep, prev: ForwardStep, tokens: list[int]) -> bool:
    """Rank 0's test of its own valid ``plan``: whether it is ``next_step(prev, tokens,
    page_size)``, field by field (a request that took a new page, finished or joined makes
    it differ), on Python lists. Building the guess's arrays took ~8 numpy calls
    (count_nonzero per row among them): 72 us a batch-1 step on rank 0's critical path, on
    caches the weight stream had just emptied, where the followers have time to spare. The
    page check is implied here: a valid plan on the same page table as ``prev`` holds every
    page its tokens need."""
    batch = len(tokens)
    if not (plan.greedy and prev.greedy and plan.feed is None and prev.feed is None
            and len(prev.q_lens) == batch == len(plan.q_lens) and batch > 0):
        return False
    return (plan.token_ids.tolist() == tokens and plan.q_lens.tolist() == [1] * batch
            and plan.logit_rows.tolist() == list(range(batch))
            and plan.cached_lens.tolist() == [c + q for c, q in zip(prev.cached_lens.tolist(),
                                                                   prev.q_lens.tolist(),
                                                                   strict=True)]
            and same_array(plan.page_table, prev.page_table))


def as_guessed(plan: ForwardStep) -> AsGuessed:
    return AsGuessed(plan_fingerprint(plan))


class GuessMissed(Exception):  # noqa: N818 -- control flow, not an error
    """Rank 0 sent something other than ``AsGuessed``: the message to run instead."""

    def __init__(self, msg: StepMessage) -> None:
        super().__init__(type(msg).__name__)
        self.msg = msg
