"""FastAPI app: SGLang-compatible ``/generate`` plus health, info, abort and flush endpoints.

Every client error becomes ``400 {"error": {"message": ...}}``; a handler never lets an
exception escape into uvicorn, so one bad request cannot disturb another.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from tpserve.engine.request import RequestOutput
from tpserve.server.engine_client import BadRequest, EngineClient, EngineUnavailable, Overloaded
from tpserve.server.openapi_util import json_body
from tpserve.server.protocol import AbortRequest, ErrorResponse, GenerateRequest, HealthResponse
from tpserve.server.state import ServerState
from tpserve.server.streams import SSE_DONE, GuardedStream, Item, collect, collect_all, merged, sse

T = TypeVar("T", bound=BaseModel)


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers=headers)


def response_dict(out: RequestOutput, index: int | None, logprobs: bool) -> dict[str, Any]:
    meta = dict(out.meta)
    if logprobs:
        meta["output_token_logprobs"] = [[lp, tok] for tok, lp, _ in out.logprobs]
        meta["output_top_logprobs"] = [top for _, _, top in out.logprobs]
    body: dict[str, Any] = {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
    if index is not None:
        body["index"] = index
    return body


def normalise(req: GenerateRequest, client: EngineClient) -> list[tuple[list[int], Any, str | None]]:
    """One (ids, params, rid) per output sequence; raises BadRequest."""
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        if any(t == "" for t in texts) or not texts:
            raise BadRequest("prompt is empty")
        prompts = [client.tokenize(t) for t in texts]
    else:
        ids = req.input_ids or []
        prompts = ids if ids and isinstance(ids[0], list) else [ids]  # type: ignore[list-item]
    raw = req.sampling_params
    raws = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(raws) != len(prompts):
        raise BadRequest("sampling_params list must match the number of prompts")
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise BadRequest("rid list must match the number of prompts")
    items = []
    for ids, params_raw, rid in zip(prompts, raws, rids, strict=True):
        client.check_prompt(ids)
        params = client.parse_params(params_raw)
        if req.return_logprob:
            params = client.validated(replace(params, logprobs=max(params.logprobs,
                                                                   req.top_logprobs_num)))
        for k, p in enumerate(client.expand_n(params)):
            items.append((ids, p, rid if k == 0 and len(prompts) == 1 else None))
    return items


async def _stream(client: EngineClient, items: list[Item], batched: bool, logprobs: bool
                  ) -> AsyncIterator[bytes]:
    async for index, out in merged(client, items):
        yield sse(response_dict(out, index if batched else None, logprobs))
    yield SSE_DONE


async def body_or_error(raw: Request, model: type[T]) -> T | JSONResponse:
    """``parse_body``, with a client error already turned into its 400 response."""
    try:
        return await parse_body(raw, model)
    except BadRequest as exc:
        return error(400, str(exc))


async def parse_body(raw: Request, model: type[T]) -> T:
    """Parse a JSON body whatever the Content-Type (``curl -d`` sends a form type)."""
    data = await raw.body()
    try:
        payload = json.loads(data or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise BadRequest(f"invalid request{' at ' + where if where else ''}: {first['msg']}") from None


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tpserve", version="0.1.0")
    responses: dict[int | str, dict[str, Any]] = {400: {"model": ErrorResponse}}

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error(400, f"invalid request{' at ' + where if where else ''}: {first.get('msg', exc)}")

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

    @app.post("/generate", responses={**responses, 503: {"model": ErrorResponse}},
              openapi_extra=json_body(GenerateRequest))
    async def generate(raw: Request) -> Any:
        body = await body_or_error(raw, GenerateRequest)
        if isinstance(body, JSONResponse):
            return body
        problem = state.unhealthy_reason()
        if problem:
            return error(503, problem, {"Retry-After": "1"})
        client = state.client
        try:
            items = normalise(body, client)
            batched = len(items) > 1 or isinstance(body.text, list) or (
                bool(body.input_ids) and isinstance(body.input_ids[0], list))
            admission = client.admit(len(items))
            if body.stream:
                return GuardedStream(_stream(client, items, batched, body.return_logprob), admission)
            with admission:
                outs = await collect_all(client, items)
        except BadRequest as exc:
            return error(400, str(exc))
        except (Overloaded, EngineUnavailable) as exc:
            return error(503, str(exc), {"Retry-After": "1"})
        bodies = [response_dict(o, None, body.return_logprob) for o in outs]
        return bodies if batched else bodies[0]

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return state.model_info()

    busy: dict[int | str, dict[str, Any]] = {503: {"model": ErrorResponse}}  # engine not answering

    @app.get("/get_server_info", responses=busy)
    async def server_info() -> dict[str, Any]:
        return await state.server_info()

    @app.post("/abort_request", responses=busy)
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        found = await state.client.call(lambda eng: eng.scheduler.abort(body.rid))
        return {"success": bool(found)}

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
