"""One request's output events on their way from the engine thread to the event loop.

Events are cumulative (``text``, ``output_ids``, ``logprobs``) with deltas on top
(``new_text``, ``new_ids``), and each carries a copy of the output so far. A client that reads
its stream slowly stalls its consumer, so queued events would grow quadratically with the
output length (32k tokens unread: ~4 GB of id lists). Instead, events that arrive while one
is pending are merged into it: the latest cumulative state with the deltas concatenated,
which is what the consumer would have made of them in order.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from tpserve.engine.request import RequestOutput


def merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    return replace(newer, new_text=older.new_text + newer.new_text,
                   new_ids=older.new_ids + newer.new_ids)


class EventMailbox:
    """At most one pending event; ``put`` runs on the event loop (via call_soon_threadsafe)."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        self._pending = out if self._pending is None else merge(self._pending, out)
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        out, self._pending = self._pending, None
        assert out is not None
        return out
