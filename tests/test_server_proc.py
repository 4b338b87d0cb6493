"""The test servers' launcher: a port taken between choosing it and the server binding it (an
outgoing connection drawing it from the ephemeral range) costs a retry, not a failed test."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import tests.server_proc as server_proc

FLAGS = ("--dtype", "float32", "--context-length", "256", "--kv-cache-gb", "0.05",
         "--skip-server-warmup")


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_port_taken_before_the_server_binds_it_is_retried(
        tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    handed: list[int] = []
    real = server_proc.free_port

    def first_taken() -> int:
        port = real() if handed else taken_port
        handed.append(port)
        return port

    monkeypatch.setattr(server_proc, "free_port", first_taken)
    with server_proc.running_server(1, *FLAGS, cache=tmp_path) as (url, _):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert handed[0] == taken_port and f":{taken_port}" not in url
    assert "Address already in use" in (tmp_path / f"server-{taken_port}.log").read_text()
