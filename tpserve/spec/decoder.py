"""The speculative decoder behind the narrow interface the engine calls.

Every rank: ``feed`` (a plain forward that also feeds the draft), ``run`` (draft + verify),
``commit`` (apply the accepted paths), ``apply`` (a live settings change).
Rank 0 only: ``draft_feed`` / ``plan`` build the messages, ``accept`` decides the paths and
the tokens each request gets, ``finish_step`` records statistics once tokens are appended.
The decoder owns its state (pending draft features, settings, statistics); the engine never
reaches into it, and it never reaches into the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpserve.engine.messages import DraftFeed, ForwardStep, SpecCommit, SpecSettings, SpecStep
from tpserve.engine.request import Request
from tpserve.engine.runner import ForwardOutput
from tpserve.spec.config import SpecConfig
from tpserve.spec.drafter import Drafter, PhaseScope, Verified
from tpserve.spec.stats import SpecStats, record_request
from tpserve.spec.verify import Accepted, accept_batch, node_logits, token_logprobs

Logprobs = list[tuple[int, float, Any]] | None
# Pending draft rows a request may hold while speculation steps aside: the batched extend
# that writes them costs about one draft forward whatever their number, so deferring
# amortises it; the cap bounds the memory (rows x hidden) and the catch-up work.
MAX_DEFERRED = 32


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

    @property
    def cfg(self) -> SpecConfig:
        return self.drafter.cfg

    # ---- every rank ----

    def feed(self, step: ForwardStep) -> ForwardOutput:
        return self.drafter.feed(step)

    def run(self, step: SpecStep, phase: PhaseScope) -> Verified:
        return self.drafter.run(step, phase)

    def commit(self, step: SpecStep, commit: SpecCommit, verified: Verified) -> None:
        self.drafter.commit(step.keys, verified, commit.paths())

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

    def draft_feed(self, reqs: Sequence[Request], live: Sequence[Request],
                   q_lens: Sequence[int]) -> DraftFeed:
        """What a plain step must tell every rank's drafter about ``reqs``."""
        fresh = [r.num_cached == r.cached_prefix for r in reqs]
        defer = [self._defers(r, new, q) for r, new, q in zip(reqs, fresh, q_lens, strict=True)]
        prev = [[] if new or late else self._held_tokens(r)
                for r, new, late in zip(reqs, fresh, defer, strict=True)]
        return DraftFeed(np.array([request_key(r) for r in reqs], dtype=np.int64),
                         self._drops(live),
                         np.array([t for p in prev for t in p], dtype=np.int64),
                         np.array([len(p) for p in prev], dtype=np.int32),
                         np.array(fresh, dtype=np.bool_), np.array(defer, dtype=np.bool_))

    def _defers(self, req: Request, fresh: bool, q_len: int) -> bool:
        """A decode token while speculation is off: its draft row can wait (see DraftFeed)."""
        held = self.drafter.pending.get(request_key(req))
        return (not self.enabled and not fresh and q_len == 1 and held is not None
                and len(held) < MAX_DEFERRED)

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
        pages = np.zeros((len(reqs), max(len(r.pages) for r in reqs)), dtype=np.int32)
        for b, req in enumerate(reqs):
            pages[b, : len(req.pages)] = req.pages
        cached = [r.seq_len - n for r, n in zip(reqs, lens, strict=True)]
        return SpecStep(tokens, np.array(lens, dtype=np.int32), np.array(cached, dtype=np.int32),
                        pages, np.array([request_key(r) for r in reqs], dtype=np.int64),
                        self._drops(live))

    def accept(self, reqs: Sequence[Request], verified: Verified) -> Decision:
        """Choose each request's accepted path (greedy match or rejection sampling)."""
        reqs = list(reqs)
        eos = sorted({t for r in reqs for t in r.eos_ids})
        tree = verified.tree
        logits = node_logits(reqs, tree.tokens, tree.parents, verified.logits.float(), eos)
        accepted = accept_batch(reqs, tree.tokens, tree.parents, logits)
        logprobs = [token_logprobs(req, acc, logits[b])
                    for b, (req, acc) in enumerate(zip(reqs, accepted, strict=True))]
        return Decision(SpecCommit.of([a.nodes for a in accepted]), accepted, logprobs)

    def finish_step(self, reqs: Sequence[Request], decision: Decision) -> None:
        """After the tokens are appended: per-request and server statistics."""
        for req, acc in zip(reqs, decision.accepted, strict=True):
            record_request(req, acc)
        self.stats.record(decision.accepted, self.cfg.num_steps)

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot()
