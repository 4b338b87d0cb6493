"""OpenAI-compatible endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Each request becomes one engine request per (prompt, choice), admitted together (``n``
choices count n), run concurrently, and returned as one object or streamed as server-sent
events ending in ``data: [DONE]``, as the official ``openai`` client expects.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tpserve.chat_template import ChatTemplate
from tpserve.engine.sampling_params import MAX_STOP_STRINGS
from tpserve.server.body import check_list, check_prompt_lists, parse_body
from tpserve.server.client_errors import ModelNotFound
from tpserve.server.engine_client import BadRequest, EngineClient, EngineUnavailable, Overloaded
from tpserve.server.http import CLIENT_GONE, error
from tpserve.server.openai_chat import offers_tools, template_inputs
from tpserve.server.openai_format import Reply, usage
from tpserve.server.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
)
from tpserve.server.openapi_util import json_body
from tpserve.server.protocol import ErrorResponse
from tpserve.server.state import ServerState
from tpserve.server.streams import (
    SSE_DONE,
    GuardedStream,
    Item,
    collect_all,
    merged,
    sse,
    unless_disconnected,
)
from tpserve.server.tool_parsers import ToolStream, make_parser

OPENAI_BODIES = (CompletionRequest, ChatCompletionRequest)
SSE_DOC = {"text/event-stream": {"schema": {"type": "string"},
                                 "example": "data: {...}\n\ndata: [DONE]\n\n"}}
# Policy, far above real conversations; keeps a chat body's validation and template
# rendering bounded before the rendered text's length can be checked.
MAX_MESSAGES = 4096


@dataclass(frozen=True)
class Prepared:
    items: list[Item]
    prompt_lens: list[int]  # one per distinct prompt
    reply: Reply
    stream: bool
    include_usage: bool


def sampling_dict(req: SamplingFields, max_tokens: int, top_logprobs: int) -> dict[str, Any]:
    """OpenAI fields in SGLang sampling-parameter names (validated by parse_params)."""
    out: dict[str, Any] = {"max_new_tokens": max_tokens, "n": req.n, "ignore_eos": req.ignore_eos,
                           "min_new_tokens": req.min_tokens, "logprobs": top_logprobs}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "stop", "logit_bias"):
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    return out


def check_request(req: SamplingFields, served: frozenset[str]) -> None:
    """What the sampling parameters cannot say: the model named is one this server serves
    (``served``: its id and the ``--model`` it was given; none named is fine), and the output
    format is plain text (a JSON mode silently ignored would hand the client text it cannot
    parse)."""
    if req.model is not None and req.model not in served:
        raise ModelNotFound(f"the model '{req.model[:200]}' does not exist on this server; it "
                            f"serves {', '.join(sorted(repr(n) for n in served))} (/v1/models)")
    kind = (req.response_format or {}).get("type", "text")
    if kind != "text":
        raise BadRequest(f"response_format type {str(kind)[:100]!r} is not supported: tpserve "
                         "has no constrained (JSON / grammar) decoding; only 'text'")


class OpenAIFrontend:
    def __init__(self, client: EngineClient, template: ChatTemplate, model_name: str,
                 served: frozenset[str] = frozenset(), tool_parser: str | None = None) -> None:
        self.client, self.template, self.model_name = client, template, model_name
        self.served = served | {model_name}
        self.tool_parser = tool_parser

    def _reply(self, chat: bool, want_logprobs: bool, tools: bool = False) -> Reply:
        """``tools``: the request offered tools, so the reply's calls are parsed (with a
        ``--tool-call-parser``)."""
        prefix = "chatcmpl-" if chat else "cmpl-"
        parser = make_parser(self.tool_parser) if tools and self.tool_parser else None
        return Reply(prefix + uuid.uuid4().hex, int(time.time()), self.model_name, chat,
                     self.client.tokenizer, want_logprobs, parser)

    def _items(self, prompts: list[list[int]], req: SamplingFields, max_tokens: int | None,
               top_logprobs: int, route_default: int | None, label: str) -> list[Item]:
        """``max_tokens`` None: the model's generation_config default, else ``route_default``
        (None: up to the context), either capped by the context left and the server limit.
        Every item carries ``label`` (the response id, which /abort_request takes)."""
        items: list[Item] = []
        fallback = self.client.sampling_defaults.get("max_new_tokens", route_default)
        for ids in prompts:
            self.client.check_prompt(ids)
            budget = self.client.limits.context_length - len(ids)
            limit = min(self.client.limits.max_new_tokens_limit, budget)
            default = limit if fallback is None else min(int(fallback), limit)
            params = self.client.parse_params(
                sampling_dict(req, default if max_tokens is None else max_tokens, top_logprobs))
            items.extend((ids, p, label) for p in self.client.expand_n(params))
        return items

    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        check_request(req, self.served)
        if req.echo:
            raise BadRequest("echo is not supported")
        if req.suffix:
            raise BadRequest("suffix is not supported (no insertion mode)")
        if req.best_of is not None and req.best_of != req.n:
            raise BadRequest("best_of is not supported: ask for n choices and pick")
        prompts = await self._prompts(req.prompt)
        reply = self._reply(False, req.logprobs is not None)
        # OpenAI's default of 16 applies only when neither the request nor the model sets one.
        asked = req.max_tokens if "max_tokens" in req.model_fields_set else None
        items = self._items(prompts, req, asked, req.logprobs or 0, 16, reply.id)
        return Prepared(items, [len(p) for p in prompts], reply, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage))

    async def _prompts(self, prompt: Any) -> list[list[int]]:
        encoder = self.client.encoder
        if isinstance(prompt, str):
            return [await encoder.encode(prompt)]
        if not prompt:
            raise BadRequest("prompt is empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        for p in prompt:  # every length first: refuse before tokenizing any of them
            if isinstance(p, str):
                encoder.check_chars(len(p))
        return [await encoder.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def chat_text(self, req: ChatCompletionRequest) -> str:
        """The prompt text transformers' ``apply_chat_template`` would give."""
        messages, tools = template_inputs(req)
        return self.template.render(messages, add_generation_prompt=True, tools=tools)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """``chat_text``'s tokens, here and now (``prepare_chat`` does it off the loop)."""
        return self.client.tokenize(self.chat_text(req), self.template.tokenize_with_special_tokens)

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        check_request(req, self.served)
        encoder = self.client.encoder
        size = sum(len(m.content) if isinstance(m.content, str) else
                   sum(len(part.text) for part in m.content or ()) for m in req.messages)
        encoder.check_chars(size)  # before rendering: the template can only add to it
        text = await encoder.run(size, self.chat_text, req)
        ids = await encoder.encode(text, self.template.tokenize_with_special_tokens)
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        top = (req.top_logprobs or 0) if req.logprobs else 0
        reply = self._reply(True, req.logprobs, offers_tools(req))
        items = self._items([ids], req, max_tokens, top, None, reply.id)
        return Prepared(items, [len(ids)], reply, req.stream,
                        bool(req.stream_options and req.stream_options.include_usage))

    async def respond(self, prep: Prepared, raw: Request) -> Any:
        admission = self.client.admit(len(prep.items), [prep.reply.id])
        if prep.stream:
            return GuardedStream(self._stream(prep), admission)
        with admission:
            outs = await unless_disconnected(raw.receive, collect_all(self.client, prep.items))
        if outs is None:
            return error(CLIENT_GONE, "client disconnected")
        return {**prep.reply.header(False),
                "choices": [prep.reply.choice(i, o) for i, o in enumerate(outs)],
                "usage": usage(prep.prompt_lens, outs)}

    async def _stream(self, prep: Prepared) -> AsyncIterator[bytes]:
        reply = prep.reply
        if reply.chat:
            yield sse(reply.role_chunk(len(prep.items)))
        seen = [0] * len(prep.items)  # logprob entries already sent, per choice
        finals: dict[int, Any] = {}
        parser = reply.tool_parser
        tools = [ToolStream(parser) for _ in prep.items] if parser is not None else None
        try:
            async for index, out in merged(self.client, prep.items):
                new_lps, seen[index] = out.logprobs[seen[index]:], len(out.logprobs)
                if out.finished:
                    finals[index] = out
                elif not out.new_text and not (reply.want_logprobs and new_lps):
                    continue  # tokens whose text is held back (partial UTF-8, stop prefix)
                if tools is None:
                    choice = reply.delta(index, out, new_lps)
                else:
                    choice = reply.tool_delta(index, out, new_lps, tools[index])
                    if not (choice["delta"] or out.finished or reply.want_logprobs):
                        continue  # text that may still become a call is held back
                yield sse({**reply.header(True), "choices": [choice]})
        except (BadRequest, EngineUnavailable, RuntimeError) as exc:
            yield sse({"error": {"message": str(exc), "type": "server_error", "code": 500}})
        if prep.include_usage:
            outs = [finals[i] for i in sorted(finals)]
            yield sse({**reply.header(True), "choices": [], "usage": usage(prep.prompt_lens, outs)})
        yield SSE_DONE


def openai_precheck(client: EngineClient) -> Callable[[dict[str, Any]], None]:
    """Batch sizes and list lengths checked on the raw JSON, before validating any item."""
    limits = client.limits

    def check(payload: dict[str, Any]) -> None:
        check_prompt_lists(payload, "prompt", limits.capacity, limits.context_length)
        check_list(payload, "messages", MAX_MESSAGES, "messages")
        check_list(payload, "stop", MAX_STOP_STRINGS, "stop strings")

    return check


async def _handle(raw: Request, state: ServerState, model: type[Any],
                  prepare: Callable[[Any], Awaitable[Prepared]],
                  respond: Callable[[Prepared, Request], Awaitable[Any]]) -> Any:
    """Parse, check health, run; map failures to the standard error bodies."""
    try:
        body = await parse_body(raw, model, openai_precheck(state.client))
        problem = state.unhealthy_reason()
        if problem:
            return error(503, problem, {"Retry-After": "1"})
        return await respond(await prepare(body), raw)
    except ModelNotFound as exc:
        return error(404, str(exc))
    except (BadRequest, ValueError) as exc:  # ValueError: the chat template's raise_exception
        return error(400, str(exc)[:1000])
    except (Overloaded, EngineUnavailable) as exc:
        return error(503, str(exc), {"Retry-After": "1"})


def register_openai(app: FastAPI, state: ServerState, template: ChatTemplate,
                    model_name: str) -> None:
    given = state.args.model  # the --model as typed (a path or a repo id) names it too
    front = OpenAIFrontend(state.client, template, model_name,
                           frozenset({given} if given else ()), state.args.tool_call_parser)
    errors: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
        503: {"model": ErrorResponse}}

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**errors, 200: {"content": SSE_DOC}},
              openapi_extra=json_body(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await _handle(raw, state, CompletionRequest, front.prepare_completion, front.respond)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**errors, 200: {"content": SSE_DOC}},
              openapi_extra=json_body(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await _handle(raw, state, ChatCompletionRequest, front.prepare_chat, front.respond)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(id=model_name, created=int(time.time()),
                         max_model_len=state.client.limits.context_length)
        return ModelList(data=[card])
