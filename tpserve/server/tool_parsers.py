"""Tool calls read out of a chat model's text (``--tool-call-parser``), as vLLM's parsers of
the same names return them.

- ``hermes`` (Hermes 2/3, Qwen 2.5 / Qwen 3 templates): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; text
  before the first call is the message content.
- ``llama3_json`` (Llama 3.1 / 3.2 templates): the whole reply is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several joined by ``;``), optionally after
  ``<|python_tag|>``; anything else is plain content.

A block that does not parse as a call stays in the content: a model that wrote something
call-like but malformed is shown as written, not dropped. Streaming (``ToolStream``) holds back
only what may still turn into a call, and emits each call whole once it is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


def new_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry; ``arguments`` as the JSON text OpenAI sends."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": text}}


def _call_of(obj: Any, args_key: str) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return new_call(obj["name"], obj.get(args_key, obj.get("arguments", {})))


class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls) of a reply: the text outside the calls (unstripped) and the calls
        in order."""

    def stable(self, text: str, finished: bool) -> int:
        """How many leading characters of ``text`` (a reply so far) can no longer change what
        ``parse`` makes of them: content before them is final, calls among them complete."""


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"

    def _blocks(self, text: str) -> tuple[list[tuple[int, int, str]], int]:
        """Complete blocks (start, end, inner) and where an unclosed one starts (or -1)."""
        blocks, at = [], 0
        while True:
            start = text.find(self.START, at)
            if start < 0:
                return blocks, -1
            end = text.find(self.END, start + len(self.START))
            if end < 0:
                return blocks, start
            blocks.append((start, end + len(self.END), text[start + len(self.START):end]))
            at = end + len(self.END)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        blocks, _ = self._blocks(text)
        content, calls, at = [], [], 0
        for start, end, inner in blocks:
            try:
                call = _call_of(json.loads(inner), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                continue  # left in the content below
            content.append(text[at:start])
            calls.append(call)
            at = end
        content.append(text[at:])
        return "".join(content), calls

    def stable(self, text: str, finished: bool) -> int:
        if finished:
            return len(text)
        blocks, open_at = self._blocks(text)
        if open_at >= 0:
            return open_at
        # a tail that may be the start of "<tool_call>" waits for the next characters
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        body = text.strip()
        body = body[len(self.TAG):].strip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in body.split(";"):
            try:
                call = _call_of(json.loads(part), "parameters")
            except json.JSONDecodeError:
                return text, []
            if call is None:
                return text, []
            calls.append(call)
        return "", calls

    def stable(self, text: str, finished: bool) -> int:
        head = text.lstrip()
        maybe_call = (not head or head.startswith("{") or head.startswith(self.TAG)
                      or self.TAG.startswith(head))
        return len(text) if finished or not maybe_call else 0


PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser}


def make_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown --tool-call-parser '{name}' (known: "
                         f"{', '.join(sorted(PARSERS))})") from None


@dataclass
class ToolStream:
    """One streamed choice's text, turned into content and tool-call deltas as it grows."""

    parser: ToolParser
    sent_content: int = 0  # characters of content already sent
    calls: list[dict[str, Any]] = field(default_factory=list)  # those already sent
    parsed: int = 0  # the stable prefix parsed last: a longer one is needed for any news

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta (``content`` and/or ``tool_calls``) the reply so far adds; {} if none."""
        upto = self.parser.stable(text, finished)
        if upto <= self.parsed:  # e.g. every token inside an open call: nothing to parse again
            return {}
        self.parsed = upto
        content, calls = self.parser.parse(text[:upto])
        delta: dict[str, Any] = {}
        if len(content) > self.sent_content:  # content only grows: see ToolParser.stable
            delta["content"] = content[self.sent_content:]
            self.sent_content = len(content)
        sent = len(self.calls)
        fresh = calls[sent:]
        if fresh:
            delta["tool_calls"] = [{"index": sent + i, **c} for i, c in enumerate(fresh)]
            self.calls.extend(fresh)
        return delta
