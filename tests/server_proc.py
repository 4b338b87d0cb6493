"""Launch a real tpserve server under torchrun for tests, on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.harness import free_port

PORT_TRIES = 3


@contextmanager
def running_server(ranks: int, *flags: str, cache: Path, env: dict[str, str] | None = None,
                   timeout: float = 180, launcher_flags: tuple[str, ...] = (),
                   while_starting: Callable[[str, Path], None] | None = None,
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A live server; ``while_starting(url, log)`` runs right after launch, before it is ready.

    ``cache`` holds the server's log. Native kernels come from the run's own build cache
    (``$TPSERVE_CACHE``, content-keyed, so sharing it is safe): building them afresh for every
    server, on every rank at once, cost minutes of a loaded CI machine's start-up timeout.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for attempt in range(PORT_TRIES):
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-port", str(free_port()), *launcher_flags, "-m", "tpserve",
               "--port", str(port), *flags]
        log = open(cache / f"server-{port}.log", "w")
        proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            if while_starting is not None:
                while_starting(url, cache / f"server-{port}.log")
            wait_healthy(url, proc, timeout, cache / f"server-{port}.log")
        except BaseException as exc:
            stop(proc)
            log.close()
            # A port free_port() saw free was taken before the server bound it (an outgoing
            # connection of another test drew it from the same ephemeral range): a new one.
            if (isinstance(exc, RuntimeError) and "address already in use" in str(exc).lower()
                    and attempt + 1 < PORT_TRIES):
                continue
            raise
        break
    try:
        yield url, proc
    finally:
        stop(proc)
        log.close()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"server not healthy in {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode
