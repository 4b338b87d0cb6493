"""docker/healthcheck.py: the address it probes and its verdicts, against loopback servers.

The demo-server case (200 from a real tpserve) is in test_docker_entrypoint.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType

import pytest

from tests.harness import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "docker" / "healthcheck.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docker_healthcheck", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hc = load()


@pytest.mark.parametrize("argv, url", [
    ([], "http://127.0.0.1:30000/health"),
    (["--port", "8000"], "http://127.0.0.1:8000/health"),
    (["--port=8001", "--model", "/m"], "http://127.0.0.1:8001/health"),
    (["--host", "0.0.0.0", "--port", "9"], "http://127.0.0.1:9/health"),
    (["--host", "::"], "http://127.0.0.1:30000/health"),
    (["--host", "10.1.2.3"], "http://10.1.2.3:30000/health"),
    (["--host", "::1", "--port", "7"], "http://[::1]:7/health"),
    (["--port", "1", "--port", "2"], "http://127.0.0.1:2/health"),  # argparse: last wins
    # torchrun's own flags come first on PID 1's command line and are not ours.
    (["/venv/bin/torchrun", "--standalone", "--rdzv-endpoint", "h:5", "-m", "tpserve",
      "--host", "0.0.0.0", "--port", "8080"], "http://127.0.0.1:8080/health"),
])
def test_url_from_server_arguments(argv: list[str], url: str) -> None:
    assert hc.health_url(argv) == url


class Status(BaseHTTPRequestHandler):
    code = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.code if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"server is starting (loading)")

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def serving(code: int) -> Iterator[int]:
    handler = type("Handler", (Status,), {"code": code})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=30, env=env)


@pytest.mark.parametrize("code, exit_code", [(200, 0), (503, 1), (404, 1)])
def test_exit_code_follows_health_status(code: int, exit_code: int) -> None:
    with serving(code) as port:
        out = run("--", "--host", "0.0.0.0", "--port", str(port))
    assert out.returncode == exit_code, out.stdout + out.stderr
    assert f"127.0.0.1:{port}/health: {code}" in out.stdout


def test_nothing_listening_is_unhealthy() -> None:
    out = run("--", "--port", str(free_port()))
    assert out.returncode == 1 and "refused" in out.stdout.lower()


@pytest.mark.parametrize("env", [{"NODE_RANK": "1"}, {"NNODES": "2", "NODE_RANK": "0"}])
def test_multi_node_passes_where_nothing_listens_but_not_on_a_bad_answer(env: dict[str, str]
                                                                       ) -> None:
    # c10d's rendezvous, not NODE_RANK, decides which node holds global rank 0 (and HTTP).
    assert run("--", "--port", str(free_port()), env=env).returncode == 0
    with serving(503) as port:
        assert run("--", "--port", str(port), env=env).returncode == 1
    with serving(200) as port:
        assert run("--", "--port", str(port), env=env).returncode == 0
    assert run("--", "--port", str(free_port()), env={"NODE_RANK": "0"}).returncode == 1


def test_reads_the_first_process_command_line_by_default(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv("NODE_RANK", raising=False)
    with serving(200) as port:
        monkeypatch.setattr(hc, "first_process_args",
                            lambda: ["tini", "--", "tpserve-entrypoint", "--port", str(port)])
        assert hc.main([]) == 0
    monkeypatch.setattr(hc, "first_process_args", lambda: ["tini", "--", "--port", "1"])
    assert hc.main([]) == 1
