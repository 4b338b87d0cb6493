"""FastAPI app: SGLang-compatible ``/generate`` plus health, info, abort and flush endpoints.

Every client error becomes ``4xx {"error": {"message": ...}}``; a handler never lets an
exception escape into uvicorn, so one bad request cannot disturb another.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from tpserve.engine.request import RequestOutput
from tpserve.server.body import check_list, check_prompt_lists, parse_body
from tpserve.server.engine_client import BadRequest, EngineClient, EngineUnavailable, Overloaded
from tpserve.server.labels import MAX_LABEL_CHARS, LabelInUse, new_label
from tpserve.server.openapi_util import json_body
from tpserve.server.protocol import AbortRequest, ErrorResponse, GenerateRequest, HealthResponse
from tpserve.server.state import ServerState
from tpserve.server.streams import (
    SSE_DONE,
    GuardedStream,
    Item,
    collect,
    collect_all,
    merged,
    sse,
    unless_disconnected,
)

T = TypeVar("T", bound=BaseModel)
CLIENT_GONE = 499  # nginx's "client closed request": only the access log and metrics see it


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers=headers)


def response_dict(out: RequestOutput, index: int | None, logprobs: bool,
                  label: str) -> dict[str, Any]:
    meta = {**out.meta, "id": label}  # the client's rid (or the id we made), not the engine's
    if logprobs:
        meta["output_token_logprobs"] = [[lp, tok] for tok, lp, _ in out.logprobs]
        meta["output_top_logprobs"] = [top for _, _, top in out.logprobs]
    body: dict[str, Any] = {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
    if index is not None:
        body["index"] = index
    return body


def generate_precheck(client: EngineClient) -> Any:
    """Batch sizes and prompt lengths checked on the raw JSON, before validating any item."""
    limits = client.limits

    def check(payload: dict[str, Any]) -> None:
        check_prompt_lists(payload, "text", limits.capacity, limits.context_length)
        check_prompt_lists(payload, "input_ids", limits.capacity, limits.context_length)
        for key in ("sampling_params", "rid"):
            check_list(payload, key, limits.capacity, "items")

    return check


def prompt_labels(rid: str | list[str] | None, prompts: int) -> list[str]:
    """One label per prompt: the client's rid(s), or ids we make."""
    if rid is None:
        return [new_label() for _ in range(prompts)]
    labels = rid if isinstance(rid, list) else [rid] * prompts
    if len(labels) != prompts:
        raise BadRequest("rid list must match the number of prompts")
    if isinstance(rid, list) and len(set(labels)) != len(labels):
        raise BadRequest("rid list must not repeat a rid")
    if any(not 0 < len(label) <= MAX_LABEL_CHARS for label in labels):
        raise BadRequest(f"a rid must have 1-{MAX_LABEL_CHARS} characters")
    return labels


async def prompt_ids(req: GenerateRequest, client: EngineClient) -> list[list[int]]:
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if req.input_ids is not None:
        ids = req.input_ids
        return ids if ids and isinstance(ids[0], list) else [ids]  # type: ignore[list-item]
    texts = req.text if isinstance(req.text, list) else [req.text]
    if not texts or any(t == "" for t in texts):
        raise BadRequest("prompt is empty")
    for text in texts:  # every length first: refuse before tokenizing any of them
        client.encoder.check_chars(len(text))
    return [await client.encoder.encode(text) for text in texts]


async def normalise(req: GenerateRequest, client: EngineClient) -> list[Item]:
    """One (ids, params, label) per output sequence; raises BadRequest."""
    prompts = await prompt_ids(req, client)
    raw = req.sampling_params
    raws = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(raws) != len(prompts):
        raise BadRequest("sampling_params list must match the number of prompts")
    labels = prompt_labels(req.rid, len(prompts))
    items = []
    for ids, params_raw, label in zip(prompts, raws, labels, strict=True):
        client.check_prompt(ids)
        params = client.parse_params(params_raw)
        if req.return_logprob:
            params = client.validated(replace(params, logprobs=max(params.logprobs,
                                                                   req.top_logprobs_num)))
        items.extend((ids, p, label) for p in client.expand_n(params))
    return items


async def _stream(client: EngineClient, items: list[Item], batched: bool, logprobs: bool
                  ) -> AsyncIterator[bytes]:
    async for index, out in merged(client, items):
        yield sse(response_dict(out, index if batched else None, logprobs, items[index][2]))
    yield SSE_DONE


async def body_or_error(raw: Request, model: type[T]) -> T | JSONResponse:
    """``parse_body``, with a client error already turned into its 400 response."""
    try:
        return await parse_body(raw, model)
    except BadRequest as exc:
        return error(400, str(exc))


async def _generate(raw: Request, state: ServerState) -> Any:
    client = state.client
    body = await parse_body(raw, GenerateRequest, generate_precheck(client))
    problem = state.unhealthy_reason()
    if problem:
        return error(503, problem, {"Retry-After": "1"})
    items = await normalise(body, client)
    batched = len(items) > 1 or isinstance(body.text, list) or (
        bool(body.input_ids) and isinstance(body.input_ids[0], list))
    admission = client.admit(len(items), list(dict.fromkeys(item[2] for item in items)))
    if body.stream:
        return GuardedStream(_stream(client, items, batched, body.return_logprob), admission)
    with admission:
        outs = await unless_disconnected(raw.receive, collect_all(client, items))
    if outs is None:
        return error(CLIENT_GONE, "client disconnected")
    bodies = [response_dict(o, None, body.return_logprob, it[2]) for o, it in zip(outs, items)]
    return bodies if batched else bodies[0]


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tpserve", version="0.1.0")
    responses: dict[int | str, dict[str, Any]] = {400: {"model": ErrorResponse}}

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = str(first.get("msg", "invalid value"))[:300]
        return error(400, f"invalid request{' at ' + where if where else ''}: {message}")

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        # Unknown paths and methods: the same error body as every other answer.
        return error(exc.status_code, str(exc.detail), dict(exc.headers or {}) or None)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, exc: EngineUnavailable) -> JSONResponse:
        return error(503, str(exc), {"Retry-After": "1"})

    @app.get("/health", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def health() -> Any:
        problem = state.unhealthy_reason()
        return error(503, problem) if problem else {"status": "ok"}

    @app.get("/health_generate", response_model=HealthResponse, responses={503: {"model": ErrorResponse}})
    async def health_generate() -> Any:
        problem = state.unhealthy_reason()
        if problem:
            return error(503, problem)
        client = state.client
        params = client.parse_params({"max_new_tokens": 1, "temperature": 0})
        try:
            with client.admit(1):
                await collect(client, (client.tokenize("ping") or [0], params, None))
        except Overloaded as exc:
            return error(503, str(exc), {"Retry-After": "1"})
        return {"status": "ok"}

    @app.post("/generate", responses={**responses, 409: {"model": ErrorResponse},
                                      503: {"model": ErrorResponse}},
              openapi_extra=json_body(GenerateRequest))
    async def generate(raw: Request) -> Any:
        try:
            return await _generate(raw, state)
        except BadRequest as exc:
            return error(400, str(exc))
        except LabelInUse as exc:
            return error(409, str(exc))
        except (Overloaded, EngineUnavailable) as exc:
            return error(503, str(exc), {"Retry-After": "1"})

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return state.model_info()

    busy: dict[int | str, dict[str, Any]] = {503: {"model": ErrorResponse}}  # engine not answering

    @app.get("/get_server_info", responses=busy)
    async def server_info() -> dict[str, Any]:
        return await state.server_info()

    @app.post("/abort_request", responses={**responses, **busy},
              openapi_extra=json_body(AbortRequest))
    async def abort_request(raw: Request) -> Any:
        body = await body_or_error(raw, AbortRequest)
        if isinstance(body, JSONResponse):
            return body
        # A label names the requests of whoever sent it (labels are unique while in flight).
        return {"success": state.client.abort_label(body.rid)}

    @app.post("/flush_cache", responses=busy)
    async def flush_cache() -> dict[str, Any]:
        # Pages that running requests hold stay; success (as in SGLang) means the cache is empty.
        def flush(eng: Any) -> tuple[int, int]:
            freed = eng.scheduler.flush_cache()
            cache = eng.scheduler.cache
            return freed, cache.num_pages if cache is not None else 0

        freed, kept = await state.client.call(flush)
        return {"success": kept == 0, "flushed_pages": freed,
                "message": "" if kept == 0 else f"{kept} pages are in use by running requests"}

    return app
