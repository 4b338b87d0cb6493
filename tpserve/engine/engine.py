"""Rank 0's engine loop and the follower loop of the other ranks.

Rank 0 runs ``Engine.run`` in a thread: it drains commands from the HTTP side, asks the
scheduler for a batch, sends the plan over the control channel, runs its own shard of the
forward, samples, and emits outputs. Followers run ``follow``: receive a plan, run the same
forward (their allreduces pair with rank 0's), repeat. Only rank 0 samples; the tokens
reach the followers inside the next plan, so every rank sees identical inputs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tpserve.engine.admin import apply_change, spec_enabled, spec_settings, validate_change
from tpserve.engine.finish import append_tokens, emit_progress
from tpserve.engine.plan import StepPlan
from tpserve.engine.profiler import StepProfiler, TraceCapture
from tpserve.engine.request import Request
from tpserve.engine.runner import ModelRunner
from tpserve.engine.sampler import apply_min_tokens, apply_penalties, sample
from tpserve.engine.scheduler import ScheduledBatch, Scheduler
from tpserve.spec.leader import bookkeeping, spec_decode_step
from tpserve.spec.worker import SpecDecoder

log = logging.getLogger(__name__)


class Channel(Protocol):
    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...


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
    extra: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, channel: Channel | None,
                 context_length: int, spec: SpecDecoder | None = None) -> None:
        self.runner = runner
        self.spec = spec  # speculative decoding (EAGLE-3) when enabled
        self.scheduler = scheduler
        self.channel = channel
        self.context_length = context_length
        self.inbox: queue.Queue[Command] = queue.Queue()
        self.stats = EngineStats()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.profiler = StepProfiler(runner.comm)
        self.trace: TraceCapture | None = None  # a torch.profiler capture in progress

    def submit(self, cmd: Command) -> None:
        self.inbox.put(cmd)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._drain(block=not self.scheduler.has_work())
                start = time.perf_counter()
                batch = self.scheduler.next_batch()
                if batch is not None:
                    with self.profiler.step(start):
                        self.profiler.record("schedule", time.perf_counter() - start)
                        self.step(batch)
                    self._trace_tick()
        except BaseException as exc:  # surfaced to /health and the process exit code
            log.exception("engine loop failed")
            self.error = exc
        finally:
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.finish(req, "server shutting down")
            try:
                self.broadcast(StepPlan(kind="shutdown"))
            except Exception as exc:  # a follower is already gone: nobody left to tell
                log.warning("could not broadcast shutdown: %s", exc)
                self.error = self.error or exc

    def broadcast(self, plan: StepPlan) -> None:
        if self.channel is not None:
            start = time.perf_counter()
            self.channel.send(plan)
            self.stats.control_seconds += time.perf_counter() - start

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

    def step(self, batch: ScheduledBatch) -> None:
        if spec_enabled(self.spec) and batch.kind == "decode":
            spec_decode_step(self, batch)
            return
        prof = self.profiler
        start = time.perf_counter()
        plan = self.scheduler.plan(batch)
        if self.spec is not None:
            plan.extra.update(bookkeeping(self.spec, self.scheduler, batch.requests))
        with prof.phase("control"):
            self.broadcast(plan)
        with prof.phase(batch.kind):
            # With a draft loaded, plain steps still feed it (spec.prefill), so speculation
            # can be switched on live for requests already running.
            out = self.spec.prefill(plan) if self.spec is not None else self.runner.forward(plan)
        with prof.phase("sample"):
            sampling = [r for r, s in zip(batch.requests, batch.samples()) if s]
            tokens, logprobs = self.sample(sampling, out.logits) if sampling else ([], [])
        with prof.phase("output"):
            for req, q in zip(batch.requests, batch.q_lens):
                req.num_cached += q
            for req, token, lp in zip(sampling, tokens, logprobs):
                append_tokens(req, [token], self.context_length, [lp])
                emit_progress(req)
            self.scheduler.release_finished()
        self._account(batch, time.perf_counter() - start)

    def reconfigure(self, change: dict[str, Any]) -> dict[str, Any]:
        """Validate and apply a live change on every rank; returns the active settings."""
        lookahead = self.scheduler.cfg.decode_lookahead
        valid = validate_change(change, self.runner.comm, self.spec, lookahead)
        if valid:
            self.broadcast(StepPlan(kind="admin", extra=valid))
            apply_change(valid, self.runner, self.spec)
        if change.get("profiling") is not None:
            if self.runner.comm is not None:
                self.runner.comm.set_profiling(bool(change["profiling"]))
            self.profiler.enabled = bool(change["profiling"])
        if change.get("reset_stats"):
            self.reset_stats()
        return self.active_settings()

    def active_settings(self) -> dict[str, Any]:
        comm = self.runner.comm
        return {"allreduce": comm.active_name if comm is not None else None,
                "speculative": spec_settings(self.spec), "profiling": self.profiler.enabled}

    def reset_stats(self) -> None:
        self.profiler.reset()
        self.stats.extra.pop("spec", None)
        if self.spec is not None:
            self.spec.timing.clear()

    def start_trace(self, steps: int, path: str) -> TraceCapture:
        if self.trace is not None:
            raise ValueError("a profiler trace is already being captured")
        self.trace = TraceCapture.start(steps, path)
        return self.trace

    def _trace_tick(self) -> None:
        if self.trace is not None and self.trace.tick():
            self.trace = None

    def sample(self, reqs: list[Request], logits: torch.Tensor) -> tuple[list[int], list[Any]]:
        params = [r.params for r in reqs]
        logits = apply_penalties(logits, params, [r.prompt_ids for r in reqs],
                                 [r.output_ids for r in reqs])
        eos = sorted({t for r in reqs for t in r.eos_ids})
        logits = apply_min_tokens(logits, params, [len(r.output_ids) for r in reqs], eos)
        result = sample(logits, params, [r.generator for r in reqs])
        tokens = result.tokens.tolist()
        lps = result.logprobs.tolist()
        tops = result.top_logprobs or [None] * len(reqs)
        return tokens, [(t, lp, top) for t, lp, top in zip(tokens, lps, tops)]

    def _account(self, batch: ScheduledBatch, seconds: float) -> None:
        self.stats.steps += 1
        self.stats.step_seconds += seconds
        if batch.kind == "prefill":
            self.stats.prefill_tokens += sum(batch.q_lens)
        else:
            self.stats.decode_tokens += len(batch.requests)


def follow(runner: ModelRunner, channel: Channel, spec: SpecDecoder | None = None) -> None:
    """Non-zero ranks: execute plans until told to stop."""
    while True:
        plan: StepPlan = channel.recv()
        if plan.kind == "shutdown":
            return
        if plan.kind == "forward":
            if spec is not None:
                spec.prefill(plan)
            else:
                runner.forward(plan)
        elif plan.kind == "spec" and spec is not None:
            spec.follow_step(plan, channel)
        elif plan.kind == "admin":
            apply_change(plan.extra, runner, spec)
