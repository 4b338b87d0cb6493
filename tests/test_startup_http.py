"""The start-up responder: 503 on every path while loading, then a gap-free hand-over."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tests.harness import free_port
from tpserve.errors import ConfigError
from tpserve.server.startup_http import StartupResponder, bind_listener


def _real_server(listener: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    return server, thread


def test_starting_then_hand_over_without_refusing_connections() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    responder = StartupResponder(bind_listener("127.0.0.1", port)).start()
    for _ in range(100):  # the responder thread needs a moment to start serving
        try:
            first = httpx.get(url + "/health", timeout=2)
            break
        except httpx.ConnectError:
            threading.Event().wait(0.05)
    assert first.status_code == 503 and first.headers["retry-after"] == "5"
    responder.set_stage("loading weights (torch.bfloat16)")
    other = httpx.post(url + "/generate", json={"text": "x"}, timeout=2)
    assert other.status_code == 503
    assert other.json()["error"]["message"] == "server is starting (loading weights (torch.bfloat16))"

    listener = responder.stop()
    # A client connecting between the two servers waits in the backlog instead of being refused.
    early = socket.create_connection(("127.0.0.1", port), timeout=5)
    early.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    server, thread = _real_server(listener)
    thread.start()
    reply = b""
    while chunk := early.recv(4096):
        reply += chunk
    early.close()
    assert reply.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in reply
    assert httpx.get(url + "/health", timeout=2).status_code == 200
    server.should_exit = True
    thread.join(10)
    listener.close()


def test_port_in_use_fails_at_once_with_a_clear_error() -> None:
    port = free_port()
    holder = bind_listener("127.0.0.1", port)
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}") as err:
            bind_listener("127.0.0.1", port)
        assert err.value.flag == "--port"
    finally:
        holder.close()


def test_accepted_connections_have_nagle_off() -> None:
    """asyncio (so uvicorn) turns on TCP_NODELAY only for sockets whose protocol number says
    TCP; with Nagle on, a response's body waited ~40 ms for the client's delayed ACK."""
    import asyncio

    listener = bind_listener("127.0.0.1", free_port())
    port = listener.getsockname()[1]
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    assert seen and seen[0] != 0
