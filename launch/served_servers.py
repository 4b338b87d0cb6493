"""Starting tpserve servers the way a user does, for the served benchmark.

TP=1: ``python -m tpserve --model DIR``; TP=N: ``torchrun --nproc-per-node N -m tpserve
--model DIR --allreduce shm`` (torchrun run as ``python -m torch.distributed.run``, the same
program, so the server uses this interpreter). Default flags otherwise, plus a free loopback
port and whatever ``--server-args`` adds. One server runs at a time: an idle TP=2 server's
ranks, or llama.cpp's threads, would otherwise share the cores with the one being measured.
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

from launch.ports import free_port


def server_command(model: Path, tp: int, port: int, extra: list[str]) -> list[str]:
    if tp == 1:
        launcher = [sys.executable, "-m", "tpserve"]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp),
                    "--master-port", str(free_port()), "-m", "tpserve", "--allreduce", "shm"]
    return [*launcher, "--model", str(model), "--port", str(port), *extra]


@contextmanager
def served(model: Path, tp: int, extra: list[str], log: Path,
           timeout: float = 600) -> Iterator[str]:
    """The URL of a healthy server; stopped (its whole process group) on exit."""
    port = free_port()
    cmd = server_command(model, tp, port, extra)
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log)
        yield url
    finally:
        stop(proc)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
