"""The asyncio side of the engine: tokenise, validate, submit, and stream outputs back.

HTTP handlers run on uvicorn's event loop; the engine runs in its own thread. Requests go
in through the engine's inbox, and every output event is handed back to the loop with
``call_soon_threadsafe`` into a per-request asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from tokenizers import Tokenizer

from tpserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from tpserve.engine.engine import Command, Engine
from tpserve.engine.request import Request, RequestOutput
from tpserve.engine.sampler import make_generator
from tpserve.engine.sampling_params import SamplingParams


class BadRequest(ValueError):
    """Client error: becomes HTTP 400 with the message."""


class Overloaded(RuntimeError):
    """Too many requests waiting: becomes HTTP 503 with Retry-After."""


@dataclass(frozen=True)
class ClientLimits:
    vocab_size: int
    context_length: int
    max_new_tokens_limit: int
    max_queued_requests: int
    server_seed: int


class EngineClient:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, eos_ids: frozenset[int],
                 limits: ClientLimits, info: dict[str, Any]) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.limits = limits
        self.info = info
        self._counter = itertools.count()
        self.in_flight = 0

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

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
        try:
            params = SamplingParams.from_dict(raw or {})
            params.validate(self.limits.vocab_size, self.limits.max_new_tokens_limit)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        return params

    def expand_n(self, params: SamplingParams) -> list[SamplingParams]:
        """n > 1 becomes n requests; seeded ones get seed + i so they differ but reproduce."""
        if params.n == 1:
            return [params]
        return [replace(params, n=1, seed=None if params.seed is None else params.seed + i)
                for i in range(params.n)]

    async def generate(self, ids: list[int], params: SamplingParams,
                       rid: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its output events; aborts it if the caller goes away."""
        if self.in_flight >= self.limits.max_queued_requests:
            raise Overloaded("too many requests in flight")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = rid or uuid.uuid4().hex
        req = Request(
            rid=rid, prompt_ids=list(ids), params=params,
            generator=make_generator(params.seed, self.limits.server_seed + next(self._counter)),
            detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, ids),
            stop=StopChecker(params.stop), eos_ids=self.eos_ids,
            emit=lambda out: loop.call_soon_threadsafe(events.put_nowait, out),
        )
        self.in_flight += 1
        finished = False
        try:
            self.engine.submit(Command("add", req))
            while True:
                out = await events.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self.in_flight -= 1
            if not finished:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        self.engine.submit(Command("abort", rid))

    async def call(self, fn: Any) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.engine.submit(Command("call", fn, lambda r: loop.call_soon_threadsafe(
            lambda: fut.done() or fut.set_result(r))))
        return await fut
