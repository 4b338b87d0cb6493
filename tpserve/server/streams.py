"""Running several engine requests for one HTTP request, streamed or collected.

Shared by the SGLang and OpenAI front ends. Both guarantee that when the HTTP request ends
for any reason (done, client gone, server shutting down) every engine request it started is
finished or aborted and its admission released, so KV pages and queue slots come back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tpserve.engine.request import RequestOutput
from tpserve.server.engine_client import Admission, EngineClient

Item = tuple[Any, ...]  # (prompt ids, SamplingParams, label): generate()'s arguments
T = TypeVar("T")


async def collect(client: EngineClient, item: Item) -> RequestOutput:
    last = None
    async for out in client.generate(*item, stream=False):
        last = out
    assert last is not None, "generate() always ends with a finished event"
    return last


async def collect_all(client: EngineClient, items: list[Item]) -> list[RequestOutput]:
    """Final outputs in order; if one fails or we are cancelled, the others are aborted."""
    tasks = [asyncio.create_task(collect(client, it)) for it in items]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def merged(client: EngineClient, items: list[Item]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, event) from every request as they arrive, until all have finished.

    The queue is bounded so that a slow reader holds the pumps back, and each request's
    events then merge in its mailbox instead of piling up here. One request (the usual
    case) is read directly: the pump task and the queue cost a task switch and two queue
    operations per streamed token on the event loop's thread.
    """
    if len(items) == 1:
        events = client.generate(*items[0])
        try:
            async for out in events:
                yield 0, out
        finally:  # closing this generator must abort the request now, not at collection
            await events.aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(
        maxsize=len(items))

    async def pump(index: int, item: Item) -> None:
        try:
            async for out in client.generate(*item):
                await queue.put((index, out))
        except Exception as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(items)]
    remaining = len(tasks)
    try:
        while remaining:
            index, out = await queue.get()
            if out is None:
                remaining -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield index, out
    finally:
        for task in tasks:  # client went away: cancelling aborts the engine requests
            task.cancel()


def sse(payload: Any) -> bytes:
    """One server-sent event. Every streamed token is one of these on the event loop's thread,
    and a /generate event carries the whole output so far (SGLang's format): with the
    standard library's encoder that was a quarter of the loop's time per token at 256-token
    streams, beside two engine threads on two cores; orjson writes the same JSON (UTF-8 left
    unescaped, logprobs always finite: ``fused.finite_logprobs``) several times faster."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class GuardedStream(StreamingResponse):
    """A streaming response that always closes its generator and releases its admission.

    Starlette cancels the send loop when the client disconnects; an async generator that
    never started (or is suspended) would then keep its engine requests and its admission.
    """

    def __init__(self, content: AsyncIterator[bytes], admission: Admission) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            self._admission.release()


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once the client has gone (``work`` is then cancelled, which
    aborts its engine requests and frees their KV pages).

    A non-streaming handler otherwise never hears of a disconnect: nothing is sent until the
    end. ``receive`` must be past the request body, so the next message is the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task in done else None
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
