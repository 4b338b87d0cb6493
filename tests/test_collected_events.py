"""A request that is collected rather than streamed emits its first token's event and its
final one only; a streamed one emits every step's. Both end with the whole output."""

from __future__ import annotations

import pytest

from tests.harness import byte_tokenizer
from tpserve.engine.finish import abort, append_tokens, emit_progress, fail_request
from tpserve.engine.request import RequestOutput, new_request
from tpserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("stream", [True, False])
def test_collected_requests_emit_first_and_final_events(stream: bool) -> None:
    events: list[RequestOutput] = []
    req = new_request("r", [65, 66], SamplingParams(max_new_tokens=6, ignore_eos=True),
                      byte_tokenizer(), frozenset(), 0, events.append, stream=stream)
    steps = [[72], [73, 74], [75], [76, 77]]  # one step at a time, some appending several
    for tokens in steps:
        append_tokens(req, tokens, context_length=100)
        emit_progress(req)
    assert req.finished and events[-1].finished
    assert len(events) == (len(steps) if stream else 2)
    assert events[0].new_ids == [72]  # the first token still arrives at once (TTFT)
    assert events[-1].output_ids == [72, 73, 74, 75, 76, 77]
    # The events' new ids add up to the output either way, and so does the text.
    assert sum((e.new_ids for e in events), []) == events[-1].output_ids
    assert "".join(e.new_text for e in events) == events[-1].text


def test_nothing_follows_the_final_event() -> None:
    """A speculative step's events go out after the next step message; an abort or a failure
    that lands on a request whose final event already went out adds no second one."""
    events: list[RequestOutput] = []
    req = new_request("r", [65], SamplingParams(max_new_tokens=2, ignore_eos=True),
                      byte_tokenizer(), frozenset(), 0, events.append)
    append_tokens(req, [72, 73], context_length=100)
    emit_progress(req)
    assert len(events) == 1 and events[0].finished and req.final_sent
    abort(req, "client went away")
    fail_request(req, "internal error")
    emit_progress(req)
    assert len(events) == 1 and req.finish_reason == {"type": "length", "length": 2}


def test_a_failure_before_the_final_event_still_sends_one() -> None:
    events: list[RequestOutput] = []
    req = new_request("r", [65], SamplingParams(max_new_tokens=4, ignore_eos=True),
                      byte_tokenizer(), frozenset(), 0, events.append)
    append_tokens(req, [72], context_length=100)
    emit_progress(req)
    fail_request(req, "internal error")
    abort(req)
    assert [e.finished for e in events] == [False, True]
    assert events[-1].finish_reason == {"type": "abort", "message": "internal error"}
