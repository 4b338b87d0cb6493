"""A rank dying at the worst moment of start-up leaves nothing in /dev/shm and ends the job.

The worst moments are while a shared segment exists but not every rank has attached: the
shm allreduce's segment and the control channel's. A test hook (``TPSERVE_PAUSE_AT``) stops
one rank exactly there; the test kills it with SIGKILL, which no cleanup code survives.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import free_port

FLAGS = ("--device", "cpu", "--allreduce", "shm", "--dtype", "float32", "--context-length", "256",
         "--kv-cache-gb", "0.05", "--skip-server-warmup")


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def shm_entries_of(pids: set[int]) -> list[str]:
    """/dev/shm names carrying any of ``pids`` (how named segments were always named)."""
    return [n for n in os.listdir("/dev/shm") if any(re.search(rf"\D{p}(\D|$)", n) for p in pids)]


# Rank 0 dying right after creating a segment, and a follower dying before attaching to one
# (rank 0 then fails inside the rendezvous): the two ways named segments used to leak.
@pytest.mark.parametrize("where,victim", [("shm-attach", 0), ("control-attach", 1)])
def test_rank_killed_while_attaching_leaks_nothing(where: str, victim: int, tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "tpserve", "--port", str(free_port()), *FLAGS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",  # the run's shared native build cache
           "TPSERVE_PAUSE_AT": f"{where}:{victim}"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline, paused = time.monotonic() + 180, None
        while paused is None:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            paused = re.search(rf"rank {victim} \(pid (\d+)\) paused at {where}", log_path.read_text())
            time.sleep(0.1)
        pids = descendants(proc.pid) | {proc.pid}
        time.sleep(0.5)  # the other rank is now waiting for the victim inside the rendezvous
        os.kill(int(paused.group(1)), signal.SIGKILL)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code != 0
    assert shm_entries_of(pids) == []
    for pid in pids:  # every rank is gone, not just the one killed
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
