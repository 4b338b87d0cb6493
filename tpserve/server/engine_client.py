"""The asyncio side of the engine: tokenise, validate, submit, and stream outputs back.

HTTP handlers run on uvicorn's event loop; the engine runs in its own thread. Requests go
in through the engine's inbox, and every output event is handed back to the loop with
``call_soon_threadsafe`` into a per-request asyncio queue.

Admission is counted in output sequences (``n`` > 1 counts n) from acceptance until the last
event: at most ``max_running_requests + max_queued_requests`` at once, so a burst gets 503s
instead of growing the engine's queue without bound. An admission also holds the request's
labels (client ``rid``s, see ``labels``) until it is released.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Protocol

from tokenizers import Tokenizer

from tpserve.engine.engine import Command, Engine
from tpserve.engine.request import Request, RequestOutput, new_request
from tpserve.engine.sampling_params import SamplingParams
from tpserve.generation_config import with_defaults
from tpserve.server.client_errors import BadRequest, EngineUnavailable, Overloaded
from tpserve.server.labels import LabelRegistry
from tpserve.server.mailbox import EventMailbox
from tpserve.server.prompts import PromptEncoder

# Stop strings with more characters than this build their automaton (up to 64 x 256 nodes,
# ~25 ms) on a worker thread instead of the event loop.
STOP_CHARS_INLINE = 2048


@dataclass(frozen=True)
class ClientLimits:
    vocab_size: int
    context_length: int
    max_new_tokens_limit: int
    max_queued_requests: int
    server_seed: int
    max_running_requests: int = 0

    @property
    def capacity(self) -> int:
        """Sequences admitted at once: the running batch plus the bounded queue."""
        return self.max_running_requests + self.max_queued_requests


class RequestObserver(Protocol):
    """Receives per-request timings and outcomes (the metrics)."""

    def on_tokens(self, started: float, previous: float | None, now: float, count: int) -> None: ...

    def on_finish(self, outcome: str, prompt_tokens: int, output_tokens: int) -> None: ...

    def on_rejected(self, count: int) -> None: ...


class Admission:
    """``count`` admitted sequences and their labels; released exactly once (by ``with`` or
    ``release``)."""

    def __init__(self, client: EngineClient, count: int, labels: list[str]) -> None:
        self.client, self.count, self.labels, self._held = client, count, labels, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.client.in_flight -= self.count
            self.client.labels.release(self.labels)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class EngineClient:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, eos_ids: frozenset[int],
                 limits: ClientLimits, info: dict[str, Any]) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.limits = limits
        self.info = info
        self._counter = itertools.count()
        self.in_flight = 0  # admitted sequences not yet finished (only the event loop touches it)
        self.observer: RequestObserver | None = None
        # generation_config.json's sampling defaults, for parameters a request leaves out
        self.sampling_defaults: Mapping[str, Any] = MappingProxyType({})
        self.labels = LabelRegistry()
        self.encoder = PromptEncoder(tokenizer, limits.context_length)

    def admit(self, count: int, labels: list[str] | tuple[str, ...] = ()) -> Admission:
        """Reserve ``count`` sequences and ``labels``, or raise Overloaded (503), BadRequest
        (can never fit) or LabelInUse (409)."""
        capacity = self.limits.capacity
        if count > capacity:
            raise BadRequest(f"request asks for {count} sequences; the server admits at most "
                             f"{capacity} at once")
        if self.in_flight + count > capacity:
            if self.observer is not None:
                self.observer.on_rejected(count)
            raise Overloaded(f"server is at capacity ({capacity} sequences in flight); retry later")
        self.labels.claim(list(labels))
        self.in_flight += count
        return Admission(self, count, list(labels))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise BadRequest("prompt is empty")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"input_ids contains token id {bad} outside the vocabulary "
                             f"[0, {self.limits.vocab_size})")
        if len(ids) >= self.limits.context_length:
            raise BadRequest(f"prompt has {len(ids)} tokens; the context length is "
                             f"{self.limits.context_length}")

    def parse_params(self, raw: dict[str, Any] | None) -> SamplingParams:
        """A request's sampling parameters, the model's defaults filling what it left out."""
        merged = with_defaults(raw, self.sampling_defaults, self.limits.max_new_tokens_limit)
        try:
            params = SamplingParams.from_dict(merged)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        return self.validated(params)

    def validated(self, params: SamplingParams) -> SamplingParams:
        """Range checks (a 400 naming the field), then ``top_k`` clamped to the vocabulary."""
        try:
            params.validate(self.limits.vocab_size, self.limits.max_new_tokens_limit)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        return params.clamped(self.limits.vocab_size)

    def expand_n(self, params: SamplingParams) -> list[SamplingParams]:
        """n > 1 becomes n requests; seeded ones get seed + i so they differ but reproduce."""
        if params.n == 1:
            return [params]
        return [replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                for i in range(params.n)]

    async def generate(self, ids: list[int], params: SamplingParams,
                       label: str | None = None, stream: bool = True
                       ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its output events (without ``stream``, only the first
        token's and the final one); aborts it if the caller goes away.

        The caller holds an ``Admission`` for it and its ``label`` (see ``admit``); the
        engine request gets a fresh id of its own.
        """
        rid = self.labels.attach(label or "")
        started, previous = time.perf_counter(), None
        last: RequestOutput | None = None
        try:
            events = EventMailbox()
            req = await self._new_request(rid, ids, params, events, stream)
            self.engine.submit(Command("add", req))
            while True:
                last = await events.get()
                if last.new_ids and self.observer is not None:
                    now = time.perf_counter()
                    self.observer.on_tokens(started, previous, now, len(last.new_ids))
                    previous = now
                yield last
                if last.finished:
                    return
        finally:
            self.labels.detach(label or "", rid)
            finished = last is not None and last.finished
            if not finished:
                self.abort(rid)
            self._observe_end(last if finished else None, len(ids),
                              len(last.output_ids) if last else 0)

    async def _new_request(self, rid: str, ids: list[int], params: SamplingParams,
                           events: EventMailbox, stream: bool) -> Request:
        loop = asyncio.get_running_loop()
        args = (rid, ids, params, self.tokenizer, self.eos_ids,
                self.limits.server_seed + next(self._counter),
                lambda out: _deliver(loop, events, out), self.engine.device)
        make = functools.partial(new_request, stream=stream)
        stop_chars = sum(len(s) for s in params.stop)
        if stop_chars <= STOP_CHARS_INLINE:
            return make(*args)
        return await self.encoder.run(stop_chars, make, *args)

    def abort_label(self, label: str) -> bool:
        """Abort every engine request running under ``label``; False when none is."""
        rids = self.labels.engine_ids(label)
        for rid in rids:
            self.abort(rid)
        return bool(rids)

    def _observe_end(self, final: RequestOutput | None, prompt: int, output: int) -> None:
        if self.observer is None:
            return
        kind = (final.finish_reason or {}).get("type", "abort") if final else "cancelled"
        self.observer.on_finish(str(kind), prompt, output)

    def abort(self, rid: str) -> None:
        self.engine.submit(Command("abort", rid))

    async def call(self, fn: Any, timeout: float = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result.

        Raises EngineUnavailable when the engine has stopped or does not answer in time, so
        an info or metrics endpoint cannot hang on a dead engine.
        """
        if self.engine.error is not None or self.engine.stopping.is_set():
            raise EngineUnavailable("engine is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def done(result: Any) -> None:
            try:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
            except RuntimeError:  # loop closed: the caller is gone
                pass

        self.engine.submit(Command("call", fn, done))
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"engine did not answer within {timeout:.0f}s") from None


def _deliver(loop: asyncio.AbstractEventLoop, events: EventMailbox, out: RequestOutput) -> None:
    """Hand an event to the loop; after shutdown the loop is closed and nobody is listening."""
    try:
        loop.call_soon_threadsafe(events.put, out)
    except RuntimeError:
        pass
