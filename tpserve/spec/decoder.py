"""The speculative decoder behind the narrow interface the engine calls.

Every rank: ``feed`` (a plain forward that also feeds the draft), ``run`` (draft + verify),
``commit`` (apply the accepted paths), ``apply`` (a live settings change).
Rank 0 only: ``draft_feed`` / ``plan`` build the messages, ``accept`` decides the paths and
the tokens each request gets, ``finish_step`` records statistics once tokens are appended.
The decoder owns its state (pending draft features, settings, statistics); the engine never
reaches into it, and it never reaches into the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpserve.engine.messages import DraftFeed, ForwardStep, SpecCommit, SpecSettings, SpecStep
from tpserve.engine.plan_cache import PlanCache
from tpserve.engine.request import Request
from tpserve.engine.runner import ForwardOutput
from tpserve.engine.sampler import argmax_pick
from tpserve.spec.config import SpecConfig
from tpserve.spec.drafter import Drafter, Guess, PhaseScope, Verified
from tpserve.spec.stats import SpecStats, record_request
from tpserve.spec.verify import (
    Accepted,
    accept_batch,
    accept_greedy_batch,
    node_logits,
    token_logprobs,
)

Logprobs = list[tuple[int, float, Any]] | None
# Decode tokens a followed request may hold pending while speculation steps aside: the batched
# extend that writes them costs about one draft forward whatever their number, so a short
# stretch of plain steps (a re-measurement, an exploring chooser) keeps the request able to
# speculate; past it the decoder lets the request go where following no longer pays (feeding
# the draft costs a plain step ~15-35%: aux states, their projection, per-request bookkeeping).
MAX_DEFERRED = 16


def tokens_left(req: Request) -> int:
    """Most tokens ``req`` may still decode (fewer if it stops early)."""
    return req.params.max_new_tokens - len(req.output_ids)


def first_chunk(req: Request) -> bool:
    """Whether this step feeds ``req``'s first chunk since its admission."""
    return req.num_cached == req.cached_prefix


def fed_this_step(req: Request, pending: Mapping[int, Any], follow_new: bool) -> bool:
    """Whether the draft follows ``req`` through this step: a request at its first chunk
    where new ones are followed (``follow_new``), any other one the draft holds rows for."""
    return follow_new if first_chunk(req) else request_key(req) in pending


def spec_blocked(reqs: Sequence[Request], pending: Mapping[int, Any], follow_new: bool) -> int:
    """Most plain steps before none of ``reqs`` is one the draft does not follow
    (``fed_this_step``): no step speculates before."""
    return max((tokens_left(r) for r in reqs if not fed_this_step(r, pending, follow_new)),
               default=0)


def argmax_accepts(req: Request) -> bool:
    """Whether ``accept`` takes ``req``'s path from the raw verify logits' argmax alone
    (``node_logits`` leaves its rows untouched and no generator is drawn)."""
    return argmax_pick(req.params, len(req.output_ids))


def request_key(req: Request) -> int:
    # id() is unique among live requests; a reused id is reset by its first prefill chunk.
    return id(req)


@dataclass(frozen=True)
class Decision:
    """Rank 0's outcome of one speculative step."""

    commit: SpecCommit
    accepted: list[Accepted]
    logprobs: list[Logprobs]  # per request, one entry per appended token (None: not asked)


class SpecDecoder:
    def __init__(self, drafter: Drafter, enabled: bool = True) -> None:
        self.drafter = drafter
        self.enabled = enabled
        self.stats = SpecStats()
        self._plans = PlanCache()  # rank 0: the last plan's page table, reused where equal

    @property
    def cfg(self) -> SpecConfig:
        return self.drafter.cfg

    # ---- every rank ----

    def feed(self, step: ForwardStep, host_work: Callable[[], None] | None = None
             ) -> ForwardOutput:
        return self.drafter.feed(step, host_work)

    @property
    def feed_seconds(self) -> float:
        """What feeding the draft cost the last plain step past its target forward (0 when
        it followed none of the step's requests)."""
        return self.drafter.feed_seconds

    def run(self, step: SpecStep, phase: PhaseScope) -> Verified:
        return self.drafter.run(step, phase)

    def run_ahead(self, step: SpecStep, verified: Verified) -> None:
        """A drafting follower, right after verify: grow the next tree before the commit and
        plan arrive, where it can work them out itself (``Drafter.run_ahead``)."""
        self.drafter.run_ahead(step, verified)

    def discard_ahead(self) -> None:
        self.drafter.discard_ahead()

    def runs_ahead(self, step: SpecStep) -> bool:
        """Whether a drafting follower drafts ahead after ``step``'s verify."""
        return self.drafter.runs_ahead(step)

    def guessed(self, fingerprint: int, page_table: np.ndarray | None
                ) -> tuple[SpecCommit, SpecStep]:
        """A drafting follower told ``Guessed``: the commit and plan it drafted ahead for."""
        return self.drafter.guessed(fingerprint, page_table)

    def commit(self, step: SpecStep, commit: SpecCommit, verified: Verified) -> None:
        self.drafter.commit(step.keys, verified, commit.paths())

    def keep(self, step: SpecStep, commit: SpecCommit, verified: Verified) -> None:
        """Rank 0, at once: the accepted paths' pending features (the next plan counts them)."""
        self.drafter.keep(step.keys, verified, commit.paths())

    def compact(self, commit: SpecCommit, verified: Verified) -> None:
        """Rank 0, any time before its next forward: the accepted nodes' KV compaction."""
        self.drafter.compact(verified, commit.paths())

    def apply(self, settings: SpecSettings) -> None:
        self.enabled = settings.enabled
        self.drafter.set_tree_shape(SpecConfig(settings.num_steps, settings.topk,
                                               settings.num_draft_tokens))

    def settings(self) -> SpecSettings:
        cfg = self.cfg
        return SpecSettings(self.enabled, cfg.num_steps, cfg.topk, cfg.num_draft_tokens)

    # ---- rank 0 ----

    def _drops(self, live: Sequence[Request]) -> np.ndarray:
        alive = {request_key(r) for r in live}
        return np.array([k for k in self.drafter.pending if k not in alive], dtype=np.int64)

    def follows(self, req: Request) -> bool:
        """Whether the draft follows ``req`` (only such requests can speculate)."""
        return request_key(req) in self.drafter.pending

    def drafted(self, req: Request) -> int:
        """Draft KV entries written for ``req`` (entry t - 1 pairs with token t)."""
        held = self.drafter.pending.get(request_key(req))
        return 0 if held is None else max(0, req.num_cached - len(held))

    def draft_feed(self, reqs: Sequence[Request], live: Sequence[Request],
                   q_lens: Sequence[int], follow_new: bool,
                   release: bool = False) -> DraftFeed | None:
        """What a plain step must tell every rank's drafter about ``reqs`` (None: nothing).

        The draft follows a new request if ``follow_new`` at its first chunk. A followed
        request's decode token while speculation is off is deferred; past ``MAX_DEFERRED``
        of them the request is let go, unless ``follow_new`` still holds (the chooser expects
        to speculate at this batch size again): then the rows are written at once. With
        ``release`` (the chooser found following not worth it at this batch size) it is let
        go at once: the request admitted alone at the start of an 8-client burst was fed
        through its first 16 plain steps at batch 8 (~0.8 ms each on the demo pair).

        It is also let go, ``follow_new`` or not, when it would have fewer than
        ``MAX_DEFERRED`` tokens left once the step's requests the draft does not follow have
        finished (``spec_blocked``): no step speculates before then. On the demo pair the
        first request of each 8-client wave was admitted at a batch where following did not
        pay and the other seven were followed: all eight decoded plainly to the end, the
        seven fed at every step (~1.5 ms a step against ~1.25 unfollowed)."""
        pending = self.drafter.pending
        if not pending and not follow_new:
            return None  # the draft follows nothing and takes nothing on
        drop = set(self._drops(live).tolist())
        blocked: int | None = None  # worked out once a request reaches the cap
        rows, fresh, defer = [], [], []
        for b, (req, q) in enumerate(zip(reqs, q_lens, strict=True)):
            key = request_key(req)
            new = first_chunk(req)
            if new and key in pending:
                drop.add(key)  # a re-admitted request, or a finished one's reused id
            if not fed_this_step(req, pending, follow_new):
                continue
            held = None if new else pending[key]
            late = not new and not self.enabled and q == 1
            if late and held is not None and (release or len(held) >= MAX_DEFERRED):
                if blocked is None:
                    blocked = spec_blocked(reqs, pending, follow_new)
                if not follow_new or tokens_left(req) < blocked + MAX_DEFERRED:
                    drop.add(key)
                    continue
                late = False  # following still pays at this batch size: write the rows now
            rows.append(b)
            fresh.append(new)
            defer.append(late)
        if not rows and not drop:
            return None
        followed = [reqs[b] for b in rows]
        prev = [[] if new or late else self._held_tokens(r)
                for r, new, late in zip(followed, fresh, defer, strict=True)]
        return DraftFeed(np.array(rows, dtype=np.int32),
                         np.array([request_key(r) for r in followed], dtype=np.int64),
                         np.array(sorted(drop), dtype=np.int64),
                         np.array([t for p in prev for t in p], dtype=np.int64),
                         np.array([len(p) for p in prev], dtype=np.int32),
                         np.array(fresh, dtype=np.bool_), np.array(defer, dtype=np.bool_))

    def _held_tokens(self, req: Request) -> list[int]:
        """Tokens that pair with all but the last pending feature of ``req`` (none after a
        prefill chunk; the accepted run after a speculative step, if speculation was then
        switched off live)."""
        held = self.drafter.pending.get(request_key(req))
        if held is None or len(held) <= 1:
            return []
        return req.tokens(req.num_cached - len(held) + 1, req.num_cached)

    def plan(self, reqs: Sequence[Request], live: Sequence[Request]) -> SpecStep:
        """Pending tokens of each request (those whose draft KV is not yet written)."""
        lens = [len(self.drafter.pending[request_key(r)]) for r in reqs]
        tokens = np.array([t for req, n in zip(reqs, lens, strict=True)
                           for t in req.tokens(req.seq_len - n, req.seq_len)], dtype=np.int64)
        pages = self._plans.page_table([r.pages for r in reqs])
        cached = [r.seq_len - n for r, n in zip(reqs, lens, strict=True)]
        return SpecStep(tokens, np.array(lens, dtype=np.int32), np.array(cached, dtype=np.int32),
                        pages, np.array([request_key(r) for r in reqs], dtype=np.int64),
                        self._drops(live), all(argmax_accepts(r) for r in reqs))

    def accept(self, reqs: Sequence[Request], verified: Verified) -> Decision:
        """Choose each request's accepted path (greedy match or rejection sampling)."""
        reqs = list(reqs)
        eos = sorted({t for r in reqs for t in r.eos_ids})
        tree = verified.tree
        logits = node_logits(reqs, tree.tokens, tree.parents, verified.logits.float(), eos)
        if all(r.params.greedy and r.params.logprobs == 0 for r in reqs):
            pairs = accept_greedy_batch(tree.tokens, tree.parents, logits)
            accepted = [acc for acc, _ in pairs]
            logprobs: list[Logprobs] = [lps for _, lps in pairs]
        else:
            accepted = accept_batch(reqs, tree.tokens, tree.parents, logits)
            logprobs = [token_logprobs(req, acc, logits[b])
                        for b, (req, acc) in enumerate(zip(reqs, accepted, strict=True))]
        return Decision(SpecCommit.of([a.nodes for a in accepted]), accepted, logprobs)

    def guess(self, step: SpecStep, decision: Decision) -> Guess | None:
        """Rank 0: the commit and plan the other ranks assume after ``step`` when every one
        of them does (``Drafter.guessed_by_all``), else None. ``decision`` holds the argmax
        paths then (``step.greedy``), the very ones the follower found."""
        if not self.drafter.guessed_by_all(step):
            return None
        return self.drafter.guess(step, decision.accepted)

    def finish_step(self, reqs: Sequence[Request], decision: Decision) -> None:
        """After the tokens are appended: per-request and server statistics."""
        for req, acc in zip(reqs, decision.accepted, strict=True):
            record_request(req, acc)
        self.stats.record(decision.accepted, self.cfg.num_steps)

    def reset_stats(self) -> None:
        self.stats = SpecStats()
        self.drafter.reset_tree_counts()

    def snapshot(self) -> dict[str, Any]:
        # Rank 0 grows no trees when another rank drafts for all: that rank's counts.
        return {**self.stats.snapshot(), "draft_trees": self.drafter.tree_counts(),
                "drafting_rank": self.drafter.drafting_rank}
