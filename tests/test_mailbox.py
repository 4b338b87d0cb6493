"""Output events for a slow reader merge instead of piling up, and say the same thing."""

from __future__ import annotations

import asyncio

from tpserve.engine.request import RequestOutput
from tpserve.server.mailbox import EventMailbox


def event(step: int, finished: bool = False) -> RequestOutput:
    ids = list(range(step + 1))
    return RequestOutput(rid="r", text="".join(f"<{i}>" for i in ids), new_text=f"<{step}>",
                         output_ids=ids, new_ids=[step], finished=finished,
                         finish_reason={"type": "length"} if finished else None, meta={},
                         logprobs=[(i, -1.0, None) for i in ids])


def test_slow_reader_gets_merged_events_with_the_same_content() -> None:
    async def run() -> list[RequestOutput]:
        box = EventMailbox()
        got = []
        for step in range(5):  # arrives while nobody reads: one pending event at a time
            box.put(event(step))
        got.append(await box.get())
        for step in range(5, 8):
            box.put(event(step, finished=step == 7))
        got.append(await box.get())
        return got

    first, second = asyncio.run(run())
    assert first.new_ids == [0, 1, 2, 3, 4] and first.new_text == "<0><1><2><3><4>"
    assert first.output_ids == list(range(5)) and not first.finished
    assert second.new_ids == [5, 6, 7] and second.new_text == "<5><6><7>"
    assert second.finished and second.text == "".join(f"<{i}>" for i in range(8))
    assert first.new_text + second.new_text == second.text  # deltas add up to the whole


def test_reader_waits_for_the_next_event() -> None:
    async def run() -> RequestOutput:
        box = EventMailbox()
        asyncio.get_running_loop().call_later(0.01, box.put, event(0))
        return await asyncio.wait_for(box.get(), 5)

    assert asyncio.run(run()).new_ids == [0]
