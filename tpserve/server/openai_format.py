"""Engine outputs rendered as OpenAI objects: choices, stream chunks, logprobs, usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from tpserve.engine.request import RequestOutput
from tpserve.server.tool_parsers import ToolParser, ToolStream

LogprobEntry = tuple[int, float, list[tuple[int, float]] | None]


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    kind = (out.finish_reason or {}).get("type")
    return kind if kind in ("stop", "length") else "abort"


@dataclass(frozen=True)
class Reply:
    """What every choice object of one response shares."""

    id: str
    created: int
    model: str
    chat: bool
    tokenizer: Tokenizer
    want_logprobs: bool
    # --tool-call-parser's, for a chat request that offered tools (None: replies are text)
    tool_parser: ToolParser | None = None

    def header(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return self._chat_logprobs(entries) if self.chat else self._text_logprobs(entries)

    def _text_logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        tokens = [self.token(t) for t, _, _ in entries]
        offsets, at = [], 0
        for text in tokens:
            offsets.append(at)
            at += len(text)
        tops = [{self.token(t): lp for t, lp in top or []} for _, _, top in entries]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        def one(token_id: int, lp: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top or []]}
                            for t, lp, top in entries]}

    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """A complete (non-streamed) choice."""
        lps = self.logprobs(out.logprobs)
        body: dict[str, Any] = {"index": index, "logprobs": lps, "finish_reason": finish_reason(out)}
        if self.chat:
            body["message"] = {"role": "assistant", "content": out.text}
            if self.tool_parser is not None:
                content, calls = self.tool_parser.parse(out.text)
                if calls:
                    body["message"] = {"role": "assistant", "content": content.strip() or None,
                                       "tool_calls": calls}
                    body["finish_reason"] = tool_finish(body["finish_reason"])
        else:
            body["text"] = out.text
        return body

    def _chunk_choice(self, index: int, out: RequestOutput, new_logprobs: list[LogprobEntry]
                      ) -> dict[str, Any]:
        """A stream chunk's choice without its text: index, new logprobs, finish reason."""
        return {"index": index, "logprobs": self.logprobs(new_logprobs),
                "finish_reason": finish_reason(out)}

    def tool_delta(self, index: int, out: RequestOutput, new_logprobs: list[LogprobEntry],
                   stream: ToolStream) -> dict[str, Any]:
        """``delta`` for a chat stream whose tool calls are parsed: content up to where a call
        may start, and each call whole once its text is complete."""
        body = {**self._chunk_choice(index, out, new_logprobs),
                "delta": stream.feed(out.text, out.finished)}
        if stream.calls:
            body["finish_reason"] = tool_finish(body["finish_reason"])
        return body

    def delta(self, index: int, out: RequestOutput, new_logprobs: list[LogprobEntry]) -> dict[str, Any]:
        """A stream chunk's choice carrying what ``out`` added."""
        body = self._chunk_choice(index, out, new_logprobs)
        if self.chat:
            body["delta"] = {"content": out.new_text} if out.new_text or not out.finished else {}
        else:
            body["text"] = out.new_text
        return body

    def role_chunk(self, count: int) -> dict[str, Any]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(count)]
        return {**self.header(True), "choices": choices}


def tool_finish(reason: str | None) -> str | None:
    """A reply that ended by itself after calling tools ends with ``tool_calls`` (OpenAI's
    reason); one cut by the length limit says so."""
    return "tool_calls" if reason == "stop" else reason


def usage(prompt_lens: list[int], outs: list[RequestOutput]) -> dict[str, Any]:
    """Each distinct prompt counts once, however many choices (n) it produced; so do its
    tokens served from the prefix cache (the choices' mean, as they share one prompt)."""
    prompt = sum(prompt_lens)
    completion = sum(len(o.output_ids) for o in outs)
    hits = sum(int(o.meta.get("cached_tokens", 0)) for o in outs)
    cached = min(prompt, round(hits * len(prompt_lens) / max(1, len(outs))))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
