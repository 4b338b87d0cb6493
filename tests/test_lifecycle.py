"""Shutdown and failure: signals end every rank cleanly, a dead rank ends the whole job.

Each test needs its own server because each one ends it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_proc import running_server
from tpserve.server.lifecycle import Watchdog

FLAGS = ("--device", "cpu", "--dtype", "float32", "--allreduce", "shm,gloo", "--context-length", "256",
         "--kv-cache-gb", "0.05", "--shutdown-timeout-s", "20")


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tpserve-")}


def log_of(cache: Path, url: str) -> str:
    return (cache / f"server-{url.rsplit(':', 1)[1]}.log").read_text()


def stream_in_background(url: str, out: dict) -> threading.Thread:
    body = {"text": "graceful", "stream": True,
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}

    def run() -> None:
        frames = []
        with httpx.stream("POST", url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    frames.append(json.loads(line[6:]))
                out["done"] = line == "data: [DONE]" or out.get("done", False)
        out["final"] = frames[-1] if frames else None

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - start


def probe_while_starting(url: str, log: Path, seen: dict) -> None:
    """As soon as rank 0 says it listens, /health must answer: 503 "starting", or 200 if ready."""
    deadline = time.monotonic() + 120
    while "listening on" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "rank 0 never started listening"
        time.sleep(0.02)
    reply = httpx.get(url + "/health", timeout=10)
    seen.update(status=reply.status_code, body=reply.text, log=log.read_text())


def test_health_answers_503_while_loading_and_logs_each_phase(tmp_path: Path) -> None:
    seen: dict = {}
    probe = lambda url, log: probe_while_starting(url, log, seen)  # noqa: E731
    with running_server(2, *FLAGS, cache=tmp_path, while_starting=probe) as (url, _):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        log = log_of(tmp_path, url)
    if seen["status"] == 200:  # the whole start-up fit between the log line and the request
        assert "after launch: serving" in seen["log"]
    else:
        assert seen["status"] == 503 and "server is starting (" in seen["body"], seen
    rank0 = [line for line in log.splitlines() if "rank0]" in line]
    order = [next(i for i, line in enumerate(rank0) if needle in line)
             for needle in ("listening on", "loading weights", "allocating KV cache done in", "after launch")]
    assert order == sorted(order), rank0


def test_sigterm_to_rank0_finishes_in_flight_and_exits_0(tmp_path: Path) -> None:
    before = shm_names()
    with running_server(2, *FLAGS, cache=tmp_path) as (url, proc):
        pids = httpx.get(url + "/get_server_info", timeout=30).json()["rank_pids"]
        out: dict = {}
        client = stream_in_background(url, out)
        time.sleep(0.5)  # let the request start decoding
        os.kill(pids[0], signal.SIGTERM)
        code, _ = wait_exit(proc, 60)
        client.join(timeout=30)
    assert code == 0, log_of(tmp_path, url)[-3000:]
    assert out.get("done") and out["final"]["meta_info"]["finish_reason"]["type"] == "length"
    assert shm_names() <= before


def test_sigterm_to_torchrun_stops_every_rank_cleanly(tmp_path: Path) -> None:
    before = shm_names()
    with running_server(2, *FLAGS, cache=tmp_path) as (url, proc):
        os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards SIGTERM to every rank
        code, took = wait_exit(proc, 60)
    log = log_of(tmp_path, url)
    # Each rank exits 0; torchrun itself re-raises the signal it got (its exit code is 1).
    assert "rank0] INFO tpserve: exiting with code 0" in log, log[-3000:]
    assert "rank1] INFO tpserve: shutdown plan received; exiting" in log, log[-3000:]
    assert code in (0, 1) and took < 40
    assert shm_names() <= before


def health_code(url: str) -> int:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return -1  # no longer listening


def test_killed_rank_ends_the_job_nonzero(tmp_path: Path) -> None:
    # torchrun checks its workers only every 20 s here, so rank 0's own watchdog (1 s) must act
    # first. (At 5 s, torchrun's poll sometimes came within a second of the kill and tore the
    # job down before the watchdog looked: seen once in about ten runs.)
    with running_server(2, *FLAGS, cache=tmp_path, launcher_flags=("--monitor-interval", "20")
                        ) as (url, proc):
        pids = httpx.get(url + "/get_server_info", timeout=30).json()["rank_pids"]
        assert len(pids) == 2
        os.kill(pids[1], signal.SIGKILL)
        codes = {health_code(url) for _ in range(20) if not time.sleep(0.1)}
        code, took = wait_exit(proc, 60)
    log = log_of(tmp_path, url)
    assert code != 0 and took < 60
    assert f"rank 1 (pid {pids[1]}) exited" in log and "exiting with code 1" in log, log[-3000:]
    assert codes & {503, -1}, codes


class _FakeEngine:
    error = None
    stopping = threading.Event()


def test_watchdog_notices_a_dead_follower() -> None:
    child = subprocess.Popen(["sleep", "60"])
    alive = threading.Thread(target=threading.Event().wait, daemon=True)
    alive.start()
    seen: list[str] = []
    dog = Watchdog(_FakeEngine(), alive, [os.getpid(), child.pid], seen.append, interval_s=0.1)
    dog.start()
    time.sleep(0.3)
    assert not seen
    child.kill()
    child.wait()
    dog.join(timeout=5)
    assert seen and "rank 1" in seen[0]


@pytest.mark.parametrize("failure", ["engine failed: boom"])
def test_health_is_503_after_failure(failure: str) -> None:
    from tpserve.args import ServerArgs
    from tpserve.server.state import ServerState

    class Client:
        engine = _FakeEngine()

    state = ServerState(args=ServerArgs(), client=Client(), model_path="m", ready=True)  # type: ignore[arg-type]
    assert state.unhealthy_reason() is None
    state.failure = failure
    assert state.unhealthy_reason() == failure
