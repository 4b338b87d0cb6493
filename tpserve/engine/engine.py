"""Rank 0's engine loop.

``Engine.run`` runs in a thread: it drains commands from the HTTP side, asks the scheduler for
a batch, sends the step message to every rank (``engine/messages.py``), runs its own shard of
the forward, samples, and appends the tokens. Only rank 0 samples; the tokens reach the
followers inside the next message, so every rank sees identical inputs.

A step's data flows one way: scheduler -> message -> forward (every rank) -> logits ->
sampler or speculative acceptance -> ``_commit`` (the one place tokens are appended, for
plain and speculative steps alike) -> the request's output events.

An error that belongs to one request (its sampling parameters, its detokenization) fails
that request only; the engine keeps serving the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch

from tpserve.engine.adapt import AdaptiveDriver, current_setting, take_adaptive
from tpserve.engine.admin import apply_change, spec_settings, validate_change
from tpserve.engine.finish import append_tokens, emit_progress, fail_request
from tpserve.engine.follower import Channel, run_forward
from tpserve.engine.messages import (
    Committed,
    ForwardStep,
    Guessed,
    Shutdown,
    SpecCommit,
    SpecStep,
    StepMessage,
    encode,
)
from tpserve.engine.plain_guess import as_guessed, follows_as_guessed
from tpserve.engine.profiler import StepProfiler, TraceCapture
from tpserve.engine.request import Request
from tpserve.engine.runner import ModelRunner
from tpserve.engine.sampler import apply_min_tokens, apply_penalties, argmax_pick, sample
from tpserve.engine.scheduler import ScheduledBatch, Scheduler
from tpserve.spec.adaptive import OFF
from tpserve.spec.decoder import Decision, SpecDecoder
from tpserve.spec.drafter import Guess
from tpserve.spec.verify import Accepted

log = logging.getLogger(__name__)

# (request, tokens to append, their (token, logprob, top) entries or None)
Output = tuple[Request, list[int], list[Any] | None]


def picked(reqs: list[Request], picks: tuple[list[int], list[float]]
           ) -> list[tuple[Request, tuple[int, Any]]]:
    """What ``Engine._sample`` returns, from a step's greedy picks (``ForwardOutput.picks``)."""
    tokens, logprobs = picks
    return [(r, (t, (t, lp, None))) for r, t, lp in zip(reqs, tokens, logprobs, strict=True)]


@dataclass
class Command:
    kind: str  # "add" | "abort" | "call"
    payload: Any = None
    done: Callable[[Any], None] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    control_seconds: float = 0.0
    step_seconds: float = 0.0


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, channel: Channel | None,
                 context_length: int, spec: SpecDecoder | None = None) -> None:
        self.runner = runner
        self.spec = spec  # speculative decoding (EAGLE-3) when a draft is loaded
        self.scheduler = scheduler
        self.channel = channel
        self.context_length = context_length
        self.device = runner.device
        self.inbox: queue.Queue[Command] = queue.Queue()
        self.stats = EngineStats()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.profiler = StepProfiler(runner.comm)
        self.trace: TraceCapture | None = None  # a torch.profiler capture in progress
        self.mixed = True  # decode tokens and prompt chunks share a step
        self.adaptive: AdaptiveDriver | None = None  # adaptive speculation (engine/adapt.py)
        # This step's _follow_new(), decided once in next_batch: the chooser's predictions
        # behind it cost ~75 us, and admission and the draft feed must agree anyway.
        self.follow_new = False
        # Work the last step left for after the next message went out (``defer``).
        self._deferred: list[Callable[[], None]] = []
        # A speculative step's commit not yet sent: it rides with the next message
        # (``messages.Committed``), see ``_spec_step``.
        self._held_commit: SpecCommit | None = None
        self._held_guess: Guess | None = None  # what the drafting follower assumes it is
        # Requests whose output events the last plain step left for the next forward to send
        # (``_commit``, ``HostWork``).
        self._events: list[Request] = []
        # The last plain step and its picks, from which every follower works out the next
        # (``plain_guess``): a plan that is that step goes as ``AsGuessed``.
        self._plain_guess: tuple[ForwardStep, list[int]] | None = None

    def submit(self, cmd: Command) -> None:
        self.inbox.put(cmd)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._drain(block=not self.scheduler.has_work())
                if not self.step_next():
                    self.flush()
        except BaseException as exc:  # surfaced to /health and the process exit code
            log.exception("engine loop failed")
            self.error = exc
        finally:
            try:
                self.flush()
            except Exception as exc:
                log.exception("deferred step work failed at shutdown")
                self.error = self.error or exc
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.finish(req, "server shutting down")
            try:
                self.broadcast(Shutdown())
            except Exception as exc:  # a follower is already gone: nobody left to tell
                log.warning("could not broadcast shutdown: %s", exc)
                self.error = self.error or exc

    def broadcast(self, msg: StepMessage) -> None:
        if self.channel is not None:
            plain, self._plain_guess = self._plain_guess, None
            if (plain is not None and isinstance(msg, ForwardStep)
                    and follows_as_guessed(msg, *plain)):
                msg = as_guessed(msg)
            if self._held_commit is not None:
                guess, self._held_guess = self._held_guess, None
                if guess is not None and isinstance(msg, SpecStep) and guess.is_plan(msg):
                    msg = Guessed(guess.fingerprint(),
                                  None if guess.same_pages(msg) else msg.page_table)
                else:
                    msg = Committed(self._held_commit, msg)
                self._held_commit = None
            start = time.perf_counter()
            self.channel.send(encode(msg))
            self.stats.control_seconds += time.perf_counter() - start

    def _publish(self, msg: StepMessage) -> None:
        """Send a step's message, then run what the last step deferred."""
        with self.profiler.phase("control"):
            self.broadcast(msg)
        self.flush()

    def defer(self, work: Callable[[], None]) -> None:
        """Run ``work`` right after the next message goes out (or when the engine goes idle):
        host work rank 0 owes the last step but the next plan does not need (a speculative
        step's KV compaction and output events). The other ranks start the next step
        meanwhile; with one drafting rank (``Drafter.drafting_rank``) this rank's work runs
        while that rank drafts instead of before it."""
        self._deferred.append(work)

    def flush(self) -> None:
        """Run the deferred work now (before this rank's next forward, a command that may
        read the requests or the cache, or going idle)."""
        work, self._deferred = self._deferred, []
        for fn in work:
            fn()
        events = self._take_events()
        if events is not None:  # more of the step's output phase (or of an idle moment)
            start = time.perf_counter()
            events()
            self.profiler.record("output", time.perf_counter() - start, entry=False)

    def _take_events(self) -> Callable[[], None] | None:
        """Sending the events the last plain step left, as one call (None when none)."""
        reqs, self._events = self._events, []
        return (lambda: self._emit(reqs)) if reqs else None

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: Command) -> None:
        if cmd.kind != "add":
            self.flush()  # an abort or admin call sees every event sent and the KV compacted
        if cmd.kind == "add":
            self.scheduler.add(cmd.payload)
            result: Any = True
        elif cmd.kind == "abort":
            result = self.scheduler.abort(cmd.payload)
        else:  # "call": run a function on the engine thread, between steps
            try:
                result = cmd.payload(self)
            except Exception as exc:  # a bad admin call must not stop the engine
                result = exc
        if cmd.done is not None:
            cmd.done(result)

    # ---- steps ----

    def step_next(self) -> bool:
        """Schedule and run the next step, timed as one by the profiler (scheduling included)
        when it is on; False when there was nothing to run."""
        start = time.perf_counter()
        batch = self.next_batch()
        if batch is None:
            return False
        with self.profiler.step(start):
            self.profiler.record("schedule", time.perf_counter() - start)
            self.step(batch)
        self._trace_tick()
        return True

    def next_batch(self) -> ScheduledBatch | None:
        """Mixed batches (decode tokens with prompt chunks riding along), speculation on or
        off: a speculative step's verify is a tree forward that cannot carry prompt chunks,
        so while prompts are being admitted the running requests decode plainly beside them
        instead of stalling for prompt-only steps; speculation resumes with the next step
        without prompt work. (Unmixed, a burst of 8 clients on the demo pair spent its
        first ~0.2 s alternating prompt-only steps with speculative steps of 1-2 requests.)"""
        self._adapt()
        self.follow_new = self._follow_new()
        return self.scheduler.next_batch(mixed=self.mixed, drafted=self.follow_new)

    def _follow_new(self) -> bool:
        """Whether the draft follows requests admitted now: while speculation is on, and
        when the chooser drives it and finds following worth it at this batch size (a
        request it then keeps off is let go after ``MAX_DEFERRED`` tokens). Pinned off,
        requests cost what they cost without a draft."""
        spec, adaptive = self.spec, self.adaptive
        if spec is None or spec.enabled:
            return spec is not None
        return (adaptive is not None and adaptive.on
                and adaptive.chooser.worth_following(self._upcoming()))

    def _release(self) -> bool:
        """Whether followed requests stepping aside are let go at once: the chooser drives
        speculation and does not find following worth it at the coming batch size (pinned
        settings keep them for ``MAX_DEFERRED`` tokens, so a short stretch off stays cheap)."""
        adaptive = self.adaptive
        return (not self.follow_new and adaptive is not None and adaptive.on
                and self.spec is not None and not self.spec.enabled)

    def _upcoming(self) -> int:
        """The batch once waiting requests are admitted (what the next settings are for)."""
        sched = self.scheduler
        return min(len(sched.running) + len(sched.waiting), sched.cfg.max_running_requests)

    def _speculates(self, batch: ScheduledBatch) -> bool:
        """A decode batch whose every request the draft follows, with speculation on."""
        spec = self.spec
        return (spec is not None and spec.enabled and batch.kind == "decode"
                and all(spec.follows(r) for r in batch.requests))

    def step(self, batch: ScheduledBatch) -> None:
        start = time.perf_counter()
        if self.runner.comm is not None:
            self.runner.comm.check()  # a collective that failed asynchronously (cuda_p2p)
        speculating = self._speculates(batch)
        # The setting this step runs under, for the chooser (only where one is set up).
        setting = None
        if self.adaptive is not None and self.spec is not None:
            setting = current_setting(self.spec) if speculating else OFF
        if speculating:
            appended, fed = self._spec_step(batch), True
        else:
            appended, fed = self._forward_step(batch)
        seconds = time.perf_counter() - start
        self._account(batch, appended, seconds)
        if not self.scheduler.has_work():
            self.flush()  # nothing to overlap with: the events go out now
        if self.adaptive is not None and setting is not None:
            decoding = sum(1 for q in batch.q_lens if q == 1)
            # A prompt step held back running requests (else it costs every setting alike).
            stalled = len(self.scheduler.running) > len(batch.requests)
            with self.profiler.phase("adapt"):
                self.adaptive.observe(setting, batch.kind, decoding, seconds, appended,
                                      stalled, fed)

    def _phase(self, name: str) -> AbstractContextManager[None]:
        inner = self.profiler.phase(name)
        return inner if self.adaptive is None else self.adaptive.phase(inner, name)

    def _adapt(self) -> None:
        """Before a step: the chooser's setting for the running batch, applied on every rank
        between the same two steps (a ``ConfigChange``, like a live admin switch)."""
        if self.spec is None or self.adaptive is None:
            return
        # Speculation needs every running request followed by the draft.
        followed = all(self.spec.follows(r) for r in self.scheduler.running)
        change = self.adaptive.change_for(self.spec, self._upcoming(), followed)
        if change is not None:
            self.broadcast(change)
            self.flush()
            apply_change(change, self.runner.comm, self.runner.static, self.spec)

    def _live(self) -> list[Request]:
        return [*self.scheduler.running, *self.scheduler.waiting]

    def _forward_step(self, batch: ScheduledBatch) -> tuple[int, bool]:
        """A plain step: (tokens appended, whether it fed the draft; the chooser times
        unfollowed plain steps apart)."""
        prof = self.profiler
        sampling = [r for r, s in zip(batch.requests, batch.samples()) if s]
        with prof.phase("plan"):
            msg = self.scheduler.plan(batch, greedy=self._picks_greedy(sampling))
            if self.spec is not None:
                msg = replace(msg, feed=self.spec.draft_feed(batch.requests, self._live(),
                                                              batch.q_lens, self.follow_new,
                                                              self._release()))
        # The last step's events go out from inside this forward (HostWork); their time is
        # then part of this phase's.
        events = self._take_events()
        self._publish(msg)
        with self._phase(batch.kind):
            out = run_forward(self.runner, self.spec, msg, events)
        if self.channel is not None and out.picks is not None:
            self._plain_guess = (msg, out.picks[0])
        if self.adaptive is not None and self.spec is not None:
            self.adaptive.record("feed", self.spec.feed_seconds)
        with prof.phase("sample"):
            if out.picks is not None:
                sampled = picked(sampling, out.picks)
            else:
                assert out.logits is not None  # a step without picks returns logits
                sampled = self._sample(sampling, out.logits) if sampling else []
        with prof.phase("output"):
            for req, q in zip(batch.requests, batch.q_lens):
                req.num_cached += q
            appended = self._commit([(req, [tok], [lp]) for req, (tok, lp) in sampled])
        return appended, msg.feed is not None and len(msg.feed.rows) > 0

    def _picks_greedy(self, sampling: list[Request]) -> bool:
        """Whether the ranks pick this plain step's tokens in their vocab shards
        (``ModelRunner.picks_greedy``): every sampled request takes the argmax and asks for
        no top log-probabilities, which is all the full logits would serve."""
        return (self.runner.picks_greedy and bool(sampling)
                and all(argmax_pick(r.params, len(r.output_ids)) and not r.params.logprobs
                        for r in sampling))

    def _spec_step(self, batch: ScheduledBatch) -> int:
        """Draft + verify on every rank, acceptance here, then the same commit on all."""
        assert self.spec is not None
        spec, prof, reqs = self.spec, self.profiler, batch.requests
        with prof.phase("plan"):
            msg = spec.plan(reqs, self._live())
        self._publish(msg)
        verified = spec.run(msg, self._phase)
        with prof.phase("accept"):
            decision = self._accept(reqs, verified)
        if self.adaptive is not None:
            self.adaptive.chooser.observe_accepts(current_setting(spec), decision.accepted)
        if spec.runs_ahead(msg):
            # The drafting follower reads the commit only after drafting ahead, by when the
            # next plan is out too: it goes with that plan, one message instead of two.
            self._held_commit = decision.commit
            # and where it works out this very commit and plan itself, says only "as guessed"
            self._held_guess = spec.guess(msg, decision)
        else:  # followers compact while this rank plans
            with prof.phase("control"):
                self.broadcast(decision.commit)
        with prof.phase("commit"):
            spec.keep(msg, decision.commit, verified)
        self.defer(lambda: self._compact(decision.commit, verified))
        with prof.phase("output"):
            for req, acc in zip(reqs, decision.accepted, strict=True):
                req.num_cached = req.seq_len - 1 + len(acc.tokens)
            outputs = [(r, a.tokens, lp) for r, a, lp in
                       zip(reqs, decision.accepted, decision.logprobs, strict=True)
                       if not r.finished]
            return self._commit(outputs, lambda: spec.finish_step(reqs, decision), defer=True)

    def _compact(self, commit: SpecCommit, verified: Any) -> None:
        assert self.spec is not None
        with self.profiler.phase("commit"):
            self.spec.compact(commit, verified)

    def _accept(self, reqs: list[Request], verified: Any) -> Decision:
        """Acceptance for the batch; if it raises, every request of the batch fails (the
        followers still get a commit, of roots only, so all ranks stay in step)."""
        assert self.spec is not None
        try:
            return self.spec.accept(reqs, verified)
        except Exception as exc:
            log.exception("speculative acceptance failed; failing the %d requests", len(reqs))
            for req in reqs:
                fail_request(req, f"internal error while sampling: {exc}")
            roots = [Accepted([0], []) for _ in reqs]
            return Decision(SpecCommit.of([[0]] * len(reqs)), roots, [None] * len(reqs))

    def _sample(self, reqs: list[Request], logits: torch.Tensor
                ) -> list[tuple[Request, tuple[int, Any]]]:
        """(request, (token, logprob entry)) for every request that could be sampled."""
        try:
            return list(zip(reqs, self._sample_batch(reqs, logits), strict=True))
        except Exception:
            log.exception("sampling a batch of %d failed; isolating the request at fault",
                          len(reqs))
        out = []
        for i, req in enumerate(reqs):
            try:
                out.append((req, self._sample_batch([req], logits[i : i + 1])[0]))
            except Exception as exc:
                fail_request(req, f"internal error while sampling: {exc}")
        return out

    def _sample_batch(self, reqs: Sequence[Request], logits: torch.Tensor
                      ) -> list[tuple[int, Any]]:
        params = [r.params for r in reqs]
        logits = apply_penalties(logits, params, [r.prompt_ids for r in reqs],
                                 [r.output_ids for r in reqs])
        eos = sorted({t for r in reqs for t in r.eos_ids})
        logits = apply_min_tokens(logits, params, [len(r.output_ids) for r in reqs], eos)
        result = sample(logits, params, [r.generator for r in reqs])
        tokens = result.tokens.tolist()
        lps = result.logprobs.tolist()
        tops = result.top_logprobs or [None] * len(reqs)
        return [(t, (t, lp, top)) for t, lp, top in zip(tokens, lps, tops)]

    def _commit(self, outputs: list[Output],
                before_emit: Callable[[], None] | None = None, defer: bool = False) -> int:
        """The one place tokens join a request (stop checks, text, streaming); returns how
        many were appended. A request whose text handling fails is failed alone.
        ``before_emit`` runs once every token is appended (statistics the events report).
        The events go out from inside the next plain forward (``HostWork``) or at the next
        ``flush``; with ``defer``, right after the next message (``defer``). Finished
        requests are released now either way (the next plan must not include them)."""
        appended, failed = 0, set()
        for req, tokens, logprobs in outputs:
            try:
                appended += append_tokens(req, tokens, self.context_length, logprobs)
            except Exception as exc:
                log.exception("request %s failed while appending tokens", req.rid)
                fail_request(req, f"internal error while detokenizing: {exc}")
                failed.add(id(req))
        if before_emit is not None:
            before_emit()
        emitting = [req for req, _, _ in outputs if id(req) not in failed]
        if defer:
            self.defer(lambda: self._emit_later(emitting))
        else:
            self._events.extend(emitting)
        self.scheduler.release_finished()
        return appended

    def _emit(self, reqs: list[Request]) -> None:
        for req in reqs:
            try:
                emit_progress(req)
            except Exception as exc:
                log.exception("request %s failed while streaming", req.rid)
                fail_request(req, f"internal error while detokenizing: {exc}")

    def _emit_later(self, reqs: list[Request]) -> None:
        """Deferred events, timed as output on their own (the step's phase has closed)."""
        with self.profiler.phase("output"):
            self._emit(reqs)

    def _account(self, batch: ScheduledBatch, appended: int, seconds: float) -> None:
        self.stats.steps += 1
        self.stats.step_seconds += seconds
        self.stats.prefill_tokens += sum(q for q in batch.q_lens if q > 1)
        self.stats.decode_tokens += appended

    # ---- settings, statistics, traces ----

    def reconfigure(self, change: dict[str, Any]) -> dict[str, Any]:
        """Validate and apply a live change on every rank; returns the active settings.

        ``speculative.adaptive``: see ``AdaptiveDriver.take``."""
        self.flush()
        change = take_adaptive(self.adaptive, change)
        lookahead = self.scheduler.cfg.decode_lookahead
        valid = validate_change(change, self.runner.comm, self.spec, lookahead)
        if valid is not None:
            self.broadcast(valid)
            apply_change(valid, self.runner.comm, self.runner.static, self.spec)
        if change.get("profiling") is not None:
            if self.runner.comm is not None:
                self.runner.comm.set_profiling(bool(change["profiling"]))
            turning_on = bool(change["profiling"]) and not self.profiler.enabled
            self.profiler.enabled = bool(change["profiling"])
            if turning_on:  # a fresh window: per-step figures divide this window's calls
                self.profiler.reset()
        if change.get("reset_stats"):
            self.reset_stats()
        return self.active_settings()

    def active_settings(self) -> dict[str, Any]:
        comm = self.runner.comm
        spec = spec_settings(self.spec)
        if spec is not None:
            spec["adaptive"] = self.adaptive is not None and self.adaptive.on
        return {"allreduce": comm.active_name if comm is not None else None,
                "speculative": spec, "profiling": self.profiler.enabled}

    def adaptive_snapshot(self) -> dict[str, Any] | None:
        """The chooser's choice, predicted and measured tok/s (None: no chooser)."""
        return self.adaptive.snapshot() if self.adaptive is not None else None

    def reset_stats(self) -> None:
        self.profiler.reset()
        self.stats = EngineStats()
        if self.spec is not None:
            self.spec.reset_stats()

    def start_trace(self, steps: int, path: str) -> TraceCapture:
        if self.trace is not None:
            raise ValueError("a profiler trace is already being captured")
        self.trace = TraceCapture.start(steps, path)
        return self.trace

    def _trace_tick(self) -> None:
        if self.trace is not None and self.trace.tick():
            self.trace = None
