"""Two torchrun "nodes" on one machine (c10d rendezvous on loopback), 2 ranks each.

Node identity comes from torchrun (GROUP_RANK), not the hostname, so these two invocations
are two nodes to tpserve exactly as two hosts would be: ``auto`` picks ``hier``, the control
channel relays through node leaders. Greedy output must equal one node with 4 ranks, and
killing any rank on either node must end both jobs within 60 s, leaving nothing in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.harness import free_port
from tests.server_proc import running_server, wait_healthy
from tests.test_shm_startup_leak import descendants, shm_entries_of

FLAGS = ("--device", "cpu", "--dtype", "float32", "--context-length", "256",
         "--kv-cache-gb", "0.05", "--skip-server-warmup")
PROMPTS = ("def fib(n):", "import ", "class Test(")


@contextmanager
def two_nodes(tmp: Path, *flags: str) -> Iterator[tuple[str, list[subprocess.Popen], list[Path]]]:
    rdzv, port = free_port(), free_port()
    procs, logs = [], []
    # The run's own native build cache (content-keyed; see tests/server_proc.py): a fresh one
    # per test made all four ranks compile every kernel at once, minutes on a loaded CI box.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for node in range(2):
            logs.append(tmp / f"node{node}.log")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--node-rank", str(node), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--rdzv-id", f"tpserve-{rdzv}",
                   "-m", "tpserve", "--port", str(port), *FLAGS, *flags]
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not any("listening on" in p.read_text() for p in logs if p.exists()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), tail(logs)
            time.sleep(0.2)
        leader = next(i for i, p in enumerate(logs) if "listening on" in p.read_text())
        wait_healthy(url, procs[leader], 240, logs[leader])
        yield url, procs, logs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def tail(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in logs if p.exists())


def rank_pids(procs: list[subprocess.Popen]) -> dict[int, int]:
    """Global rank -> pid of every worker of both torchrun invocations."""
    found = {}
    for proc in procs:
        for pid in descendants(proc.pid):
            try:
                env = dict(kv.split("=", 1) for kv in
                           Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
            except OSError:
                continue
            if "RANK" in env and "tpserve" in Path(f"/proc/{pid}/cmdline").read_text():
                found[int(env["RANK"])] = pid
    return found


def greedy(url: str) -> list[list[int]]:
    body = {"text": list(PROMPTS), "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    reply = httpx.post(url + "/generate", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return [item["output_ids"] for item in reply.json()]


def kill_and_expect_both_end(procs: list[subprocess.Popen], logs: list[Path], victim: int) -> None:
    pids = rank_pids(procs)
    assert sorted(pids) == [0, 1, 2, 3], pids
    everyone = set().union(*(descendants(p.pid) | {p.pid} for p in procs))
    os.kill(pids[victim], signal.SIGKILL)
    start = time.monotonic()
    codes = [proc.wait(timeout=max(1.0, 60 - (time.monotonic() - start))) for proc in procs]
    took = time.monotonic() - start
    assert all(code != 0 for code in codes) and took < 60, (codes, took, tail(logs))
    assert shm_entries_of(everyone) == []


def test_two_nodes_serve_like_one_and_end_together(tmp_path: Path) -> None:
    with running_server(4, *FLAGS, cache=tmp_path) as (url, _):
        one_node = greedy(url)
    with two_nodes(tmp_path) as (url, procs, logs):
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        assert info["active"]["allreduce"] == "hier", info["active"]
        assert "allreduce auto -> hier: 2 nodes x 2 ranks" in "".join(p.read_text() for p in logs)
        assert greedy(url) == one_node
        kill_and_expect_both_end(procs, logs, victim=3)  # a follower of the other node


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_killing_any_rank_ends_both_nodes(victim: int, tmp_path: Path) -> None:
    with two_nodes(tmp_path) as (_, procs, logs):
        kill_and_expect_both_end(procs, logs, victim)
