"""Tool calls read out of chat replies (``--tool-call-parser``): the parsers on whole replies,
streamed replies cut at every point, and the OpenAI chat stream and choice built from them."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import orjson
import pytest
from tokenizers import Tokenizer

from tpserve.demo import demo_target
from tpserve.engine.request import RequestOutput
from tpserve.server.openai_api import OpenAIFrontend, Prepared
from tpserve.server.openai_format import Reply
from tpserve.server.tool_parsers import ToolStream, make_parser

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n'
          '</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}'


def calls_of(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_whole_reply() -> None:
    content, calls = make_parser("hermes").parse(HERMES)
    assert content.strip() == "Let me check."
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "unit": "c"}), ("now", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_hermes_keeps_what_is_not_a_call() -> None:
    parser = make_parser("hermes")
    for text in ("no calls here", "<tool_call>{not json}</tool_call> after",
                 '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{\"name\": \"x\""):
        assert parser.parse(text) == (text, [])


def test_llama3_json_whole_reply() -> None:
    parser = make_parser("llama3_json")
    content, calls = parser.parse(LLAMA)
    assert content == "" and calls_of(calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    _, tagged = parser.parse('<|python_tag|>{"name": "f", "parameters": {"a": 1}}')
    assert calls_of(tagged) == [("f", {"a": 1})]
    for text in ("The answer is 4.", "{not json", '{"city": "Paris"}'):
        assert parser.parse(text) == (text, [])


def test_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="known: hermes, llama3_json"):
        make_parser("mistral")


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("llama3_json", LLAMA),
                                       ("hermes", "plain <tool text> with < signs"),
                                       ("llama3_json", "plain text"),
                                       ("hermes", HERMES + "\ntrailing words")])
def test_a_stream_cut_anywhere_gives_the_whole_reply(name: str, text: str) -> None:
    whole_content, whole_calls = make_parser(name).parse(text)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
        stream = ToolStream(make_parser(name))
        content, calls = "", []
        for end in [*cuts, len(text)]:
            delta = stream.feed(text[:end], end == len(text))
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                assert call["index"] == len(calls)
                calls.append(call)
            # nothing sent is ever taken back: content is a prefix of the final content
            assert whole_content.startswith(content)
        assert content == whole_content
        assert calls_of(calls) == calls_of(whole_calls)


def _output(text: str, previous: str, finished: bool) -> RequestOutput:
    reason = {"type": "stop", "matched": 2} if finished else None
    return RequestOutput("r", text, text[len(previous):], [], [], finished, reason, {})


class _Streaming:
    """An engine client that replays a reply's text in pieces."""

    def __init__(self, text: str, step: int) -> None:
        self.text, self.step = text, step

    async def generate(self, *item: Any, **kw: Any) -> Any:
        ends = [*range(self.step, len(self.text), self.step), len(self.text)]
        previous = ""
        for end in ends:
            out = _output(self.text[:end], previous, end == len(self.text))
            previous = out.text
            yield out


def _reply(parser: str | None) -> Reply:
    tok = Tokenizer.from_file(str(demo_target() / "tokenizer.json"))
    return Reply("chatcmpl-x", 0, "m", True, tok, False,
                 make_parser(parser) if parser else None)


def test_chat_stream_and_choice_carry_the_calls() -> None:
    reply = _reply("hermes")
    front = OpenAIFrontend(_Streaming(HERMES, 7), None, "m")  # type: ignore[arg-type]
    prep = Prepared([([1], None, "chatcmpl-x")], [1], reply, True, False)

    async def chunks() -> list[dict[str, Any]]:
        return [orjson.loads(raw[len(b"data: "):]) async for raw in front._stream(prep)
                if raw != b"data: [DONE]\n\n"]

    events = asyncio.run(chunks())
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "unit": "c"}), ("now", {})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    choice = reply.choice(0, _output(HERMES, "", True))
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert calls_of(choice["message"]["tool_calls"]) == calls_of(calls)


def test_without_a_parser_calls_stay_text() -> None:
    choice = _reply(None).choice(0, _output(HERMES, "", True))
    assert choice["message"] == {"role": "assistant", "content": HERMES}
    assert choice["finish_reason"] == "stop"
    plain = _reply("hermes").choice(0, _output("just words", "", True))
    assert plain["message"] == {"role": "assistant", "content": "just words"}
    assert plain["finish_reason"] == "stop"
