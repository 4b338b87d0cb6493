"""Rank 0's side of speculative decoding: plans, acceptance, appending tokens, statistics."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tpserve.engine.finish import append_tokens, emit_progress
from tpserve.engine.plan import StepPlan
from tpserve.engine.request import Request
from tpserve.engine.scheduler import ScheduledBatch, Scheduler
from tpserve.spec.verify import Accepted, accept_batch, node_logits, token_logprobs
from tpserve.spec.worker import SpecDecoder


def request_key(req: Request) -> int:
    # id() is unique among live requests; a reused id is reset by its first prefill chunk.
    return id(req)


def bookkeeping(spec: SpecDecoder, scheduler: Scheduler, reqs: list[Request]) -> dict[str, Any]:
    """Plan extras: which state rows the step touches and which finished ones to forget."""
    live = {request_key(r) for r in (*scheduler.running, *scheduler.waiting)}
    return {"spec_keys": [request_key(r) for r in reqs],
            "spec_drop": [k for k in spec.pending if k not in live],
            "spec_prev_tokens": [_held_tokens(spec, r) for r in reqs]}


def _held_tokens(spec: SpecDecoder, req: Request) -> list[int]:
    """Tokens that pair with all but the last pending feature of ``req`` (none after a
    prefill chunk; the accepted run after a speculative step, if speculation was then
    switched off live)."""
    held = spec.pending.get(request_key(req))
    if req.num_cached == 0 or held is None or len(held) <= 1:
        return []
    return req.tokens(req.num_cached - len(held) + 1, req.num_cached)


def spec_plan(spec: SpecDecoder, scheduler: Scheduler, reqs: list[Request]) -> StepPlan:
    """Pending tokens of each request (those whose draft KV is not yet written)."""
    lens = [len(spec.pending[request_key(r)]) for r in reqs]
    tokens = np.zeros((len(reqs), max(lens)), dtype=np.int64)
    pages = np.zeros((len(reqs), max(len(r.pages) for r in reqs)), dtype=np.int32)
    for b, (req, n) in enumerate(zip(reqs, lens, strict=True)):
        tokens[b, :n] = req.tokens(req.seq_len - n, req.seq_len)
        pages[b, : len(req.pages)] = req.pages
    return StepPlan(kind="spec", token_ids=tokens, q_lens=np.array(lens, dtype=np.int32),
                    cached_lens=np.array([r.seq_len - n for r, n in zip(reqs, lens, strict=True)],
                                         dtype=np.int32),
                    page_table=pages, extra=bookkeeping(spec, scheduler, reqs))


def spec_decode_step(engine: Any, batch: ScheduledBatch) -> None:
    """One draft + verify + accept step for a decode batch (rank 0)."""
    spec: SpecDecoder = engine.spec
    prof = engine.profiler
    reqs = batch.requests
    start = time.perf_counter()
    plan = spec_plan(spec, engine.scheduler, reqs)
    with prof.phase("control"):
        engine.broadcast(plan)
    before = dict(spec.timing)
    verified = spec.draft_and_verify(plan)
    for name, phase in (("draft", "draft"), ("verify_forward", "verify")):
        prof.record(phase, spec.timing.get(name, 0.0) - before.get(name, 0.0))
    tick = time.perf_counter()
    with prof.phase("accept"):
        eos = sorted({t for r in reqs for t in r.eos_ids})
        logits = node_logits(reqs, verified.tree.tokens, verified.tree.parents,
                             verified.logits.float(), eos)
        accepted = accept_batch(reqs, verified.tree.tokens, verified.tree.parents, logits)
        paths = [a.nodes for a in accepted]
    with prof.phase("control"):
        engine.broadcast(StepPlan(kind="spec_commit", extra={"paths": paths}))
    spec.timing["accept"] = spec.timing.get("accept", 0.0) + time.perf_counter() - tick
    with prof.phase("commit"):
        spec.commit(plan.extra["spec_keys"], verified, paths)
    with prof.phase("output"):
        appended = 0
        for b, (req, acc) in enumerate(zip(reqs, accepted, strict=True)):
            req.num_cached = req.seq_len - 1 + len(acc.tokens)
            appended += append_tokens(req, acc.tokens, engine.context_length,
                                      token_logprobs(req, acc, logits[b]))
            record_request(req, acc)
            emit_progress(req)
        engine.scheduler.release_finished()
    record_server(engine, spec, accepted, appended, time.perf_counter() - start)


def record_request(req: Request, acc: Accepted) -> None:
    stats = req.stats
    stats["spec_verify_ct"] = stats.get("spec_verify_ct", 0) + 1
    hist = stats.setdefault("spec_accept_histogram", [])
    drafts = len(acc.nodes) - 1
    while len(hist) <= drafts:
        hist.append(0)
    hist[drafts] += 1  # hist[i]: verify steps that accepted exactly i draft tokens
    stats["spec_accept_length"] = len(req.output_ids) / stats["spec_verify_ct"]


def record_server(engine: Any, spec: SpecDecoder, accepted: list[Accepted], appended: int,
                  seconds: float) -> None:
    stats = engine.stats
    stats.steps += 1
    stats.step_seconds += seconds
    stats.decode_tokens += appended
    s = stats.extra.setdefault("spec", {"steps": 0, "verify_ct": 0, "accepted_drafts": 0,
                                        "position_accepts": []})
    depth = spec.cfg.num_steps  # may change live: grow the per-position counters
    s["position_accepts"] += [0] * max(0, depth - len(s["position_accepts"]))
    s["steps"] += 1
    s["verify_ct"] += len(accepted)
    for acc in accepted:
        s["accepted_drafts"] += len(acc.nodes) - 1
        for depth in range(len(acc.nodes) - 1):
            s["position_accepts"][depth] += 1
    s["avg_accept_length"] = 1 + s["accepted_drafts"] / s["verify_ct"]
    s["position_accept_rate"] = [c / s["verify_ct"] for c in s["position_accepts"]]
    s["phase_seconds_per_step"] = {k: v / s["steps"] for k, v in spec.timing.items()}
