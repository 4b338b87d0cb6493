"""Request bodies: JSON parsed with its cost bounded first, then validated into a model.

Parsing holds the GIL (and so the event loop and the engine thread) for its whole duration,
which grows with the number of JSON arrays and objects far more than with bytes: 8 MB of
``[1],`` took 0.7 s to parse where 8 MB of string or integers took 0.07-0.1 s. So a body
with more arrays and objects than ``MAX_JSON_CONTAINERS`` is refused before parsing: first
``[``/``{`` are counted at C speed, strings included; only when that count is over the
limit are they recounted outside strings, in slices that let the loop serve others between
them, and with a cap on the strings scanned. Lone UTF-16 surrogates (``"\\ud800"``) are
refused too: they cannot be tokenized or encoded back into a UTF-8 response.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from tpserve.server.client_errors import BadRequest

T = TypeVar("T", bound=BaseModel)
Precheck = Callable[[dict[str, Any]], None]

# 16,384 containers parse in ~6 ms on the 2-core CI machine; no request we serve needs as many
# (a batch is at most the admission capacity, a prompt one list of token ids, a chat at most
# MAX_MESSAGES messages of a few objects each).
MAX_JSON_CONTAINERS = 1 << 14
MAX_JSON_STRINGS = 1 << 16  # scanned when recounting; a chat at the message cap has ~16k
RECOUNT_SLICE = 4096  # matches between yields to the event loop (~1-2 ms of work)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_STRING_OR_OPEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{]')


async def parse_body(raw: Request, model: type[T], precheck: Precheck | None = None) -> T:
    """Parse a JSON body whatever the Content-Type (``curl -d`` sends a form type)."""
    data = await raw.body()
    await check_containers(data)
    payload = load_json(data)
    if precheck is not None:
        precheck(payload)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first["msg"])[:300]
        raise BadRequest(f"invalid request{' at ' + where if where else ''}: {message}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


async def check_containers(data: bytes) -> None:
    """Refuse a body with more than MAX_JSON_CONTAINERS arrays and objects, unparsed."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_CONTAINERS:
        return  # the common case: even counted inside strings, few enough
    containers = strings = 0
    for index, match in enumerate(_STRING_OR_OPEN.finditer(data), start=1):
        if len(match.group()) == 1:
            containers += 1
        else:
            strings += 1
        if containers > MAX_JSON_CONTAINERS:
            raise BadRequest(f"request body has more than {MAX_JSON_CONTAINERS} JSON arrays and "
                             "objects; no request needs that many")
        if strings > MAX_JSON_STRINGS:
            raise BadRequest(f"request body has more than {MAX_JSON_STRINGS} JSON strings and "
                             f"more than {MAX_JSON_CONTAINERS} '[' and '{{' characters")
        if index % RECOUNT_SLICE == 0:
            await asyncio.sleep(0)


def load_json(data: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(data or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    except RecursionError:
        raise BadRequest("malformed JSON body: nested too deeply") from None
    if not isinstance(payload, dict):
        raise BadRequest("request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(data) is not None:
        _refuse_lone_surrogates(payload)
    return payload


def _refuse_lone_surrogates(payload: dict[str, Any]) -> None:
    """Valid pairs decode to one character; a lone half stays a surrogate and fails UTF-8."""
    try:
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("request body contains a lone UTF-16 surrogate escape "
                         "(\\ud800-\\udfff without its pair): not valid Unicode text") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def check_list(payload: dict[str, Any], key: str, limit: int, what: str) -> None:
    """A top-level list longer than ``limit`` is refused before any item is looked at."""
    value = payload.get(key)
    if isinstance(value, list) and len(value) > limit:
        raise BadRequest(f"'{key}' has {len(value)} {what}; at most {limit} are accepted")


def check_prompt_lists(payload: dict[str, Any], key: str, capacity: int, context: int) -> None:
    """``key`` is one prompt (a string or token ids) or a batch of them."""
    value = payload.get(key)
    if not isinstance(value, list):
        return
    if value and all(isinstance(v, list) for v in value):
        check_list(payload, key, capacity, "prompts (the server admits that many sequences)")
        longest = max(len(v) for v in value)
    elif value and isinstance(value[0], str):
        check_list(payload, key, capacity, "prompts (the server admits that many sequences)")
        return
    else:
        longest = len(value)
    if longest >= context:
        raise BadRequest(f"prompt has {longest} tokens; the context length is {context}")
