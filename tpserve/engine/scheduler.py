"""Rank 0's scheduler: FCFS admission, chunked prefill, continuous batching, preemption,
prefix caching.

Each call to ``next_batch`` returns a batch for one step. Mixed (the default): every running
request's decode token plus prompt chunks filling the rest of the token budget
(``--chunked-prefill-size``; at most ``--mixed-chunk-size`` prompt tokens while anything is
decoding), so streams keep flowing while a long prompt is admitted piece by piece; with
speculation on, such a step decodes its requests plainly (a verify tree cannot carry prompt
chunks) and a decode-only batch is a speculative step. Unmixed (``--disable-mixed-chunk``): a
prefill batch or a decode batch, alternating when both kinds are ready so new prompts cannot
starve requests already decoding. When pages run out
during decode the most recently admitted request is preempted: its pages are freed and it
re-enters the queue to be recomputed (prompt + output so far) later.

With the prefix cache on, an admitted request first reuses the pages of its longest cached
prefix (``prefix_cache.py``), and every request that leaves (finished, aborted, preempted)
hands its full pages to the cache; cached pages are evicted when the free list runs dry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tpserve.engine.finish import abort
from tpserve.engine.kv_cache import PageAllocator
from tpserve.engine.messages import ForwardStep
from tpserve.engine.plan_cache import PlanCache
from tpserve.engine.prefix_cache import CacheStats, PrefixCache
from tpserve.engine.request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int
    max_running_requests: int
    chunked_prefill_size: int
    context_length: int
    # KV slots kept ahead of a decoding request's sequence (``SpecConfig.reserve``)
    decode_lookahead: int = 0
    prefix_cache: bool = True
    # Prompt tokens a step may carry beside decode tokens: a stream waits for the whole step,
    # so this bounds its stall while a long prompt is admitted (None: chunked_prefill_size).
    mixed_chunk_size: int | None = None


@dataclass
class ScheduledBatch:
    kind: str  # "prefill" | "decode" | "mixed"
    requests: list[Request]
    q_lens: list[int]

    def samples(self) -> list[bool]:
        """Whether each request gets a new token from this step (its last chunk was fed)."""
        return [r.num_cached + q == r.seq_len for r, q in zip(self.requests, self.q_lens)]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PageAllocator) -> None:
        self.cfg = cfg
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefer_decode = False
        self.preemptions = 0
        self.cache = PrefixCache(cfg.page_size) if cfg.prefix_cache else None
        # With a draft loaded: how many of a request's draft KV entries were written (the
        # speculative decoder knows); the prefix cache marks the pages they cover.
        self.drafted: Callable[[Request], int] | None = None
        self._plans = PlanCache()  # the last plan's arrays, reused by the next where equal

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def find(self, rid: str) -> Request | None:
        return next((r for r in (*self.running, *self.waiting) if r.rid == rid), None)

    def abort(self, rid: str, message: str = "aborted") -> bool:
        req = self.find(rid)
        if req is None:
            return False
        self.finish(req, message)
        return True

    def finish(self, req: Request, message: str = "aborted") -> None:
        """Remove ``req`` from every queue, free its pages and send its final event."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self._release_pages(req)
        abort(req, message)

    def _release_pages(self, req: Request) -> None:
        """Give ``req``'s full pages to the prefix cache (if on) and free the rest."""
        pages = req.pages
        if self.cache is not None:
            drafted = self.drafted(req) if self.drafted is not None else 0
            pages = self.cache.release(req.prefix_path, req.tokens(0, req.num_cached), pages,
                                       req.num_cached, drafted)
        self.allocator.free(pages)
        req.pages, req.prefix_path = [], []

    def _alloc(self, count: int) -> list[int] | None:
        pages = self.allocator.alloc(count)
        if pages is None and self.cache is not None:
            self.allocator.free(self.cache.evict(count - self.allocator.num_free))
            pages = self.allocator.alloc(count)
        return pages

    def _reuse_prefix(self, req: Request, drafted: bool) -> None:
        """On admission: start from the pages of the longest cached prefix (``drafted``: of
        those whose draft KV was written, for a request that will speculate)."""
        if self.cache is None or req.pages or req.num_cached:
            return
        path = self.cache.match(req.tokens(0, req.seq_len), drafted)
        req.prefix_path = path
        req.pages = [node.page for node in path]
        req.num_cached = req.cached_prefix = len(path) * self.cfg.page_size
        req.stats["cached_tokens"] = req.cached_prefix

    def flush_cache(self) -> int:
        """Drop every cached page no running request uses; returns how many were freed."""
        if self.cache is None:
            return 0
        freed = self.cache.flush()
        self.allocator.free(freed)
        if not self.cache.num_pages:
            self.cache.stats = CacheStats()  # an empty cache starts its hit rate afresh
        return len(freed)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_needed(self, req: Request, tokens: int) -> int:
        return -(-tokens // self.cfg.page_size) - len(req.pages)

    def reserve(self, req: Request, tokens: int) -> bool:
        """Make ``req`` own enough pages for ``tokens`` tokens."""
        need = self.pages_needed(req, tokens)
        if need <= 0:
            return True
        pages = self._alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def next_batch(self, mixed: bool = False, drafted: bool = False) -> ScheduledBatch | None:
        """``drafted``: admitted requests will speculate (they reuse only cached pages whose
        draft KV was written)."""
        if mixed:
            return self._mixed_batch(drafted)
        decode = [r for r in self.running if r.pending == 1]
        if decode and (self._prefer_decode or not self._prefill_possible()):
            self._prefer_decode = False
            return self._decode_batch()
        prefill = self._prefill_batch(drafted=drafted)
        if prefill is not None:
            self._prefer_decode = True
            return prefill
        return self._decode_batch() if decode else None

    def _prefill_possible(self) -> bool:
        return any(r.pending > 1 for r in self.running) or (
            bool(self.waiting) and len(self.running) < self.cfg.max_running_requests)

    def _mixed_batch(self, drafted: bool = False) -> ScheduledBatch | None:
        """Decode tokens first (they may preempt), then prompt chunks within what is left of
        the token budget; one forward reads the weights once for both.

        When nothing fits although requests are running, each of them is stuck mid-prompt
        holding pages: the latest admitted makes room (preempted, recomputed later).
        """
        for _ in range(len(self.running) + 1):
            batch = self._mixed_once(drafted)
            if batch is not None or not self.running:
                return batch
            self._preempt_latest()
        return None

    def _mixed_once(self, drafted: bool) -> ScheduledBatch | None:
        decode = self._decode_batch()
        taken = len(decode.requests) if decode is not None else 0
        limit = self.cfg.chunked_prefill_size - taken
        if decode is not None and self.cfg.mixed_chunk_size is not None:
            limit = min(limit, self.cfg.mixed_chunk_size)
        prefill = self._prefill_batch(limit, drafted) if limit > 0 else None
        if prefill is None or decode is None:
            return prefill or decode
        return ScheduledBatch("mixed", decode.requests + prefill.requests,
                              decode.q_lens + prefill.q_lens)

    def _prefill_batch(self, budget: int | None = None,
                       drafted: bool = False) -> ScheduledBatch | None:
        budget = self.cfg.chunked_prefill_size if budget is None else budget
        reqs, lens = [], []
        for req in [r for r in self.running if r.pending > 1]:
            q = min(req.pending, budget)
            if q <= 0 or not self.reserve(req, req.num_cached + q):
                break
            reqs.append(req)
            lens.append(q)
            budget -= q
        while budget > 0 and self.waiting and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if self._cannot_ever_fit(req):
                self.finish(req, "prompt needs more KV cache than the server has")
                continue
            self._reuse_prefix(req, drafted)
            q = min(req.pending, budget)
            if not self.reserve(req, req.num_cached + q):
                # Waiting requests hold no pages: a locked prefix here could starve everyone.
                self._release_pages(req)
                req.num_cached = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            if self.cache is not None:
                self.cache.stats.queried_tokens += req.seq_len
                self.cache.stats.hit_tokens += req.cached_prefix
            reqs.append(req)
            lens.append(q)
            budget -= q
        return ScheduledBatch("prefill", reqs, lens) if reqs else None

    def _cannot_ever_fit(self, req: Request) -> bool:
        need = req.seq_len + 1 + self.cfg.decode_lookahead
        return self.pages_needed(req, need) > self.allocator.num_usable

    def _decode_batch(self) -> ScheduledBatch | None:
        batch: list[Request] = []
        for req in [r for r in self.running if r.pending == 1]:
            need = req.seq_len + self.cfg.decode_lookahead
            while req in self.running and not self.reserve(req, need):
                self._preempt_latest()
            if req in self.running:
                batch.append(req)
        return ScheduledBatch("decode", batch, [1] * len(batch)) if batch else None

    def _preempt_latest(self) -> None:
        victim = self.running.pop()
        self._release_pages(victim)
        victim.num_cached = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def plan(self, batch: ScheduledBatch, greedy: bool = False) -> ForwardStep:
        """The compact per-step message every rank expands into tensors (ragged tokens);
        ``greedy``: the ranks pick its tokens (``ForwardStep.greedy``)."""
        reqs = batch.requests
        tokens = [t for req, q in zip(reqs, batch.q_lens)
                  for t in req.tokens(req.num_cached, req.num_cached + q)]
        q_lens, rows = self._plans.counts(batch.q_lens, batch.samples())
        return ForwardStep(
            token_ids=np.array(tokens, dtype=np.int64), q_lens=q_lens,
            cached_lens=np.array([r.num_cached for r in reqs], dtype=np.int32),
            page_table=self._plans.page_table([r.pages for r in reqs]), logit_rows=rows,
            greedy=greedy,
        )

    def release_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        for req in done:
            self.running.remove(req)
            self._release_pages(req)
        return done
