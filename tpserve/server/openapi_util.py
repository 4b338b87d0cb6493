"""OpenAPI details FastAPI cannot infer: manually parsed bodies, auth, and guard responses.

Handlers parse their JSON bodies themselves (so ``curl -d`` works whatever its Content-Type),
which hides the body from FastAPI. ``json_body`` describes it by reference, and
``finish_schema`` puts the referenced models (and their nested ``$defs``) into the
components, declares bearer auth when an API key is set, and adds the 401/413 answers the
ASGI guard can give, so schema-driven clients and fuzzers see what the server really does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for an operation whose JSON body the handler parses itself."""
    ref = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _error_response(text: str) -> dict[str, Any]:
    return {"description": text, "content": {"application/json": {
        "schema": {"$ref": REF.format(model="ErrorResponse")}}}}


def _add_models(schema: dict[str, Any], models: Iterable[type[BaseModel]]) -> None:
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        body = model.model_json_schema(ref_template=REF)
        for name, sub in body.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps.setdefault(model.__name__, body)


def _add_guards(schema: dict[str, Any], keyed: Callable[[str], bool]) -> None:
    if any(keyed(path) for path in schema.get("paths", {})):
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            answers = op.setdefault("responses", {})
            if "422" in answers:  # FastAPI's validation answer; ours is a 400 (http.py)
                del answers["422"]
                answers.setdefault("400", _error_response("invalid request"))
            if "requestBody" in op:
                answers.setdefault("413", _error_response("request body too large"))
            if keyed(path):
                op["security"] = [{"bearer": []}]
                answers.setdefault("401", _error_response("missing or wrong API key"))


def finish_schema(app: FastAPI, models: Iterable[type[BaseModel]],
                  keyed: Callable[[str], bool]) -> None:
    """Wrap ``app.openapi`` so the generated schema is completed once, on first use."""
    base = app.openapi
    body_models = tuple(models)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()  # FastAPI caches it in app.openapi_schema; we edit in place
            _add_models(schema, body_models)
            _add_guards(schema, keyed)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
