"""CPU checks of the multi-GPU paths that only a GPU host runs for real: the rank's device
binding at process-group start, the CUDA-graph executor's replay decisions (which must be the
same on every rank, since a replay runs collectives) and its recaptures, and the GPU gate's
order and limits on a multi-GPU host (with a stand-in Python that only reports GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tpserve.dist import RankInfo, init_process_group, rank_info
from tpserve.engine.buckets import inert_batch
from tpserve.engine.graphs import CudaGraphExecutor, GraphConfig, _Captured, _copy_inputs
from tpserve.engine.static_forward import StaticForward
from tpserve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


# ---- device binding --------------------------------------------------------------------

def test_a_cuda_rank_binds_its_gpu_and_gives_nccl_the_device(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda **kw: calls.append(("init", kw)))
    gpu = torch.device("cuda", 3)
    init_process_group(RankInfo(3, 8, 3, 8, gpu), 60)
    assert calls[0] == ("set_device", gpu)  # before NCCL (or anything else) touches a GPU
    kind, kw = calls[1]
    assert kind == "init" and kw["backend"] == "cpu:gloo,cuda:nccl"
    assert kw["device_id"] == gpu  # the communicator is made now, on this rank's GPU

    calls.clear()
    init_process_group(RankInfo(1, 2, 1, 2, CPU), 60)
    assert [c[0] for c in calls] == ["init"] and "device_id" not in calls[0][1]


def test_each_local_rank_gets_its_own_gpu_or_a_one_line_refusal(monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_info("cuda").device == torch.device("cuda", 3)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ConfigError, match="local rank 5 has no GPU"):
        rank_info("auto")


# ---- CUDA-graph executor (no CUDA: a stand-in graph) -------------------------------------

class FakeGraph:
    def __init__(self, outputs: tuple[torch.Tensor, ...], log: list[str]) -> None:
        self.outputs, self.log = outputs, log

    def replay(self) -> None:
        self.log.append("replay")


def executor(name: str, queries: int, bucket: int, pages: int, mask: int,
             comm: Any = None) -> tuple[CudaGraphExecutor, list[str]]:
    """An executor holding one captured bucket of ``name`` (built without CUDA)."""
    ex = object.__new__(CudaGraphExecutor)
    ex.cfg = GraphConfig((bucket,), pages * 4, 4, {name: mask})
    ex.device, ex.comm, ex.pool = CPU, comm, None
    ex.backend = comm.active_name if comm is not None else None
    ex.info = {"kind": "cuda_graph", "sets": {}}
    log: list[str] = []
    static = inert_batch(bucket, queries, pages, 4, CPU, mask)
    out = torch.arange(bucket * queries, dtype=torch.float32)
    ex.forwards = {name: StaticForward(name, queries, lambda fb, extras: (out,))}
    ex.graphs = {name: {(bucket, pages * 4): _Captured(FakeGraph((out,), log), static, {}, (out,))}}
    ex.spans = {name: {bucket: (pages * 4,)}}
    return ex, log


def test_a_plan_wider_than_the_captured_page_table_still_replays() -> None:
    # Near the context limit a request may hold pages reserved past the captured width
    # (the speculative reserve); the keys it reads stay within it.
    static = inert_batch(2, 1, 3, 4, CPU)
    wide = inert_batch(2, 1, 5, 4, CPU)
    wide.attn.page_table.copy_(torch.tensor([[7, 8, 9, 10, 11], [12, 13, 0, 0, 0]]))
    _copy_inputs(static, wide)
    assert static.attn.page_table.tolist() == [[7, 8, 9], [12, 13, 0]]


def test_a_mask_wider_than_captured_runs_eagerly_on_every_rank() -> None:
    ex, log = executor("draft", 2, 2, 3, mask=4)
    narrow = inert_batch(2, 2, 3, 4, CPU, 2)
    assert ex.run("draft", narrow, {}) is not None and log == ["replay"]
    wide = inert_batch(2, 2, 3, 4, CPU, 6)  # a live tree change widened the draft mask
    assert ex.run("draft", wide, {}) is None and log == ["replay"]


def _comm(name: str, safe: bool, world: int = 2) -> Any:
    return SimpleNamespace(active_name=name, backends={},
                           active=SimpleNamespace(world_size=world, capture_safe=safe))


def test_switching_to_a_backend_that_is_not_capture_safe_drops_the_graphs() -> None:
    comm = _comm("nccl", True)
    ex, log = executor("decode", 1, 2, 3, mask=0, comm=comm)
    captured: list[str] = []
    ex.capture = lambda forward, progress=None: captured.append(forward.name)  # type: ignore
    comm.active_name, comm.active = "hier", SimpleNamespace(world_size=2, capture_safe=False)
    ex.on_backend_change()
    assert captured == [] and ex.graphs == {} and ex.backend == "hier"
    assert ex.run("decode", inert_batch(1, 1, 3, 4, CPU), {}) is None  # eager, no replay
    # a tree change meanwhile is kept for when graphs come back
    newer = StaticForward("decode", 1, lambda fb, extras: ())
    ex.refresh([newer])
    assert captured == [] and ex.forwards["decode"] is newer
    comm.active_name, comm.active = "nccl", SimpleNamespace(world_size=2, capture_safe=True)
    ex.on_backend_change()
    assert captured == ["decode"]


# ---- the GPU gate on a multi-GPU host ------------------------------------------------------

def fake_python(tmp_path: Path, gpus: int) -> Path:
    """Reports ``gpus`` GPUs; records every step's command and limit; passes every step. The
    comm bench leaves a "rank" behind in a session of its own, as torchrun's would be."""
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f'if [ "$1" = -c ] && [[ "$2" == *device_count* ]]; then echo {gpus}; exit 0; fi\n'
                    f'if [ "$1" = - ]; then exec {sys.executable} "$@"; fi\n'
                    f'echo "STEP_LIMIT=$STEP_LIMIT $*" >> {tmp_path / "calls.txt"}\n'
                    'if [[ "$*" == *comm_backends.bench* ]]; then\n'
                    f'  setsid sleep 600 < /dev/null > /dev/null 2>&1 & echo $! > {tmp_path / "left.pid"}\n'
                    "fi\n"
                    "exit 0\n")
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize("gpus,tp,bench", [(8, 8, 8), (6, 4, 6)])
def test_multi_gpu_steps_run_first_and_within_their_own_limits(tmp_path: Path, gpus: int, tp: int,
                                                                bench: int) -> None:
    env = {**os.environ, "PYTHON": str(fake_python(tmp_path, gpus)), "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert run.returncode == 0 and summary["ok"] is True, run.stdout + run.stderr
    backends = ["auto", "nccl", "cuda_p2p", "symm_mem", "hier"]
    assert [s["step"] for s in summary["steps"]] == [
        "versions_topology", "serve_tp1", *[f"serve_tp{tp}_{b}" for b in backends],
        "comm_bench", "gpu_marked_tests", "comm_tests", "decode_table"]
    calls = [c for c in (tmp_path / "calls.txt").read_text().splitlines()
             if "pip install" not in c]
    serves = [c for c in calls if "launch.gpu_serve_check" in c]
    assert len(serves) == 6 and all(f"--ranks {tp} " in c for c in serves[1:])
    assert all(c.startswith("STEP_LIMIT=180 ") for c in serves)  # SERVE_TIMEOUT, not 300
    (bench_call,) = [c for c in calls if "comm_backends.bench" in c]
    assert f"--nproc-per-node {bench} " in bench_call and "--standalone" in bench_call
    left = int((tmp_path / "left.pid").read_text())
    for _ in range(50):
        if not _alive(left):
            break
        time.sleep(0.1)
    assert not _alive(left), "a process the bench step left running was not reaped"


# ---- the server check stops what it started, torchrun's ranks included ---------------------

HANGING_SERVER = r'''
import http.server, os, subprocess, sys, time
port, pidfile, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
# a "rank" in a session of its own, as torchrun starts them
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                        start_new_session=True)
open(pidfile, "w").write(str(rank.pid))
if mode == "never-healthy":
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        time.sleep(600)  # a step whose collective never completes
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["never-healthy", "hung-request"])
def test_a_hung_server_is_a_failure_and_its_whole_tree_is_killed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    import launch.gpu_serve_check as check

    pidfile = tmp_path / "rank.pid"
    script = tmp_path / "server.py"
    script.write_text(HANGING_SERVER)
    monkeypatch.setattr(check, "command", lambda ranks, port, ns: [
        sys.executable, str(script), str(port), str(pidfile), mode])
    out = tmp_path / "result.json"
    start = time.monotonic()
    code = check.main(["--device", "cpu", "--budget", "8", "--json", str(out),
                       "--log", str(tmp_path / "server.log")])
    assert time.monotonic() - start < 8
    result = json.loads(out.read_text())
    assert code == 1, result
    if mode == "never-healthy":
        assert "not healthy" in result["error"]
    else:
        assert any("request failed" in p for p in result["problems"]), result
    rank = int(pidfile.read_text())
    for _ in range(50):
        if not _alive(rank):
            break
        time.sleep(0.1)
    assert not _alive(rank), "the server's rank outlived the check"
