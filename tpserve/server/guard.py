"""ASGI guard in front of every route: API key, request body cap, and HTTP response counts.

A plain ASGI middleware rather than FastAPI dependencies, so it covers every route
(including the docs and ones added later) and never buffers a streaming response. The body
is read up front, up to the cap, and replayed to the app: a client sending a chunked body
without Content-Length is capped the same way, before any handler runs.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers carry no key


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None
    max_request_bytes: int


def _error(status: int, message: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    # The same body as every other error (http.error): {"error": {message, type, code}}.
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return body, headers


class Guard:
    def __init__(self, app: ASGIApp, cfg: GuardConfig,
                 on_response: Callable[[str, str, int], None] | None = None) -> None:
        self.app, self.cfg, self.on_response = app, cfg, on_response
        self._key = cfg.api_key.encode() if cfg.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # what the app answered, for the counter

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_counted)
        finally:
            if self.on_response is not None:
                self.on_response(scope["method"], scope["path"], status[0])

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._key is not None and scope["path"] not in OPEN_PATHS and not self._authorised(scope):
            await _reply(send, 401, "missing or incorrect API key: send 'Authorization: Bearer KEY'")
            return
        body = await self._read_body(scope, receive)
        if body is None:
            await _reply(send, 413, f"request body exceeds {self.cfg.max_request_bytes} bytes "
                         "(--max-request-bytes)")
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorised(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key or b"")

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
