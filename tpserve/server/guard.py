"""ASGI guard in front of every route: API keys, request body cap, HTTP response counts, and
a JSON 500 for anything a handler failed to catch.

A plain ASGI middleware rather than FastAPI dependencies, so it covers every route
(including the docs and ones added later) and never buffers a streaming response. The body
is read up front, up to the cap, and replayed to the app: a client sending a chunked body
without Content-Length is capped the same way, before any handler runs. ``/admin/*`` takes
the admin key; every other route but the open ones the API key (or the admin key).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no key
ADMIN_PREFIX = "/admin/"
log = logging.getLogger("tpserve")


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None
    max_request_bytes: int
    admin_api_key: str | None = None


def _error(status: int, message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    # The same body as every other error (http.error): {"error": {message, type, code}}.
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return body, headers


def needs_key(path: str, cfg: GuardConfig) -> bool:
    if path.startswith(ADMIN_PREFIX):
        return cfg.admin_api_key is not None
    return cfg.api_key is not None and path not in OPEN_PATHS


class Guard:
    def __init__(self, app: ASGIApp, cfg: GuardConfig,
                 on_response: Callable[[str, str, int], None] | None = None) -> None:
        self.app, self.cfg, self.on_response = app, cfg, on_response
        self._api = cfg.api_key.encode() if cfg.api_key else None
        self._admin = cfg.admin_api_key.encode() if cfg.admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]  # what the app answered, for the counter (0: nothing yet)

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_counted)
        except Exception:  # noqa: BLE001 - the one place an unexpected error becomes a 500
            log.exception("unhandled error serving %s", scope.get("path"))
            if status[0] == 0:
                await _reply(send_counted, 500, "internal server error")
        finally:
            if self.on_response is not None:
                self.on_response(scope["method"], scope["path"], status[0] or 500)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if needs_key(path, self.cfg) and not self._authorised(scope, path):
            which = "admin API key" if path.startswith(ADMIN_PREFIX) else "API key"
            await _reply(send, 401, f"missing or incorrect {which}: send 'Authorization: Bearer KEY'")
            return
        body = await self._read_body(scope, receive)
        if body is None:
            await _reply(send, 413, f"request body exceeds {self.cfg.max_request_bytes} bytes "
                         "(--max-request-bytes)")
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorised(self, scope: Scope, path: str) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # The admin key opens every route; the API key every route but /admin/*.
        allowed = [self._admin] + ([] if path.startswith(ADMIN_PREFIX) else [self._api])
        return any(key is not None and hmac.compare_digest(token, key) for key in allowed)

    async def _read_body(self, scope: Scope, receive: Receive) -> list[Message] | None:
        """The body messages, or None when it is over the cap (checked before reading)."""
        cap = self.cfg.max_request_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            return None
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # disconnect: let the app see it
            size += len(message.get("body", b""))
            if size > cap:
                return None
            if not message.get("more_body", False):
                return messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        # After the buffered body, the real channel: the app still sees a later disconnect.
        return pending.pop(0) if pending else await receive()

    return replayed


async def _reply(send: Send, status: int, message: str) -> None:
    body, headers = _error(status, message)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
