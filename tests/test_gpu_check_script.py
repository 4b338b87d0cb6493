"""The GPU gate on a machine without a GPU: it must fail, in one line, having checked nothing.
And its server step (launch/gpu_serve_check.py), run on CPU: pass, skip-on-refusal, and
REQUIRE turning that refusal into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_FLAGS = ("--", "--dtype", "float32", "--context-length", "256", "--kv-cache-gb", "0.05",
             "--skip-server-warmup")


def test_without_a_gpu_the_gate_fails_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    output = (run.stdout + run.stderr).strip()
    assert run.returncode != 0
    assert len(output.splitlines()) == 1 and "no CUDA GPU visible" in output, output
    assert not (tmp_path / "gpu_check.json").exists()  # no summary that could read as a pass


def serve_check(tmp_path: Path, *args: str, require: str = "") -> tuple[int, dict]:
    out = tmp_path / "result.json"
    env = {**os.environ, "REQUIRE": require, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "launch.gpu_serve_check", "--device", "cpu",
                          "--json", str(out), "--log", str(tmp_path / "server.log"), *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return run.returncode, json.loads(out.read_text()) if out.exists() else {"stderr": run.stderr}


def test_serve_check_sends_a_sampled_and_a_greedy_request(tmp_path: Path) -> None:
    code, result = serve_check(tmp_path, "--ranks", "1", "--allreduce", "shm", *CPU_FLAGS)
    assert code == 0, result
    assert len(result["sampled"]["output_ids"]) == 32 and len(result["greedy"]["output_ids"]) == 32
    assert result["sampled"]["output_ids"] != result["greedy"]["output_ids"]
    assert result["problems"] == [] and result["exit_code"] == 0


@pytest.mark.parametrize("require,expected", [("", 3), ("nccl", 1)])
def test_a_refused_backend_is_skipped_unless_required(require: str, expected: int,
                                                      tmp_path: Path) -> None:
    code, result = serve_check(tmp_path, "--ranks", "1", "--allreduce", "nccl", *CPU_FLAGS,
                               require=require)
    assert code == expected, result
    assert "nccl" in result["refused"] and result["required"] == bool(require)


def test_a_server_that_fails_otherwise_is_a_failure_not_a_skip(tmp_path: Path) -> None:
    # The attention backend cannot run here: a start-up error that names no allreduce backend.
    code, result = serve_check(tmp_path, "--ranks", "1", "--allreduce", "shm", "--",
                               "--attention-backend", "flashinfer", *CPU_FLAGS[1:])
    assert code == 1, result
    assert "refused" not in result and "server exited" in result["error"]


def test_only_allreduce_refusals_count_and_never_auto_on_one_rank() -> None:
    from launch.gpu_serve_check import refusals

    log = ("error: the KV budget gives only 1 pages\n"
           "error: allreduce backend 'nccl' needs device cuda, got cpu\n"
           "error: no allreduce backend for 2 ranks on cpu\n")
    assert refusals(log, "nccl", 2) == [
        "error: allreduce backend 'nccl' needs device cuda, got cpu",
        "error: no allreduce backend for 2 ranks on cpu"]
    assert refusals(log, "auto", 1) == []
    assert refusals("error: the KV budget gives only 1 pages\n", "shm", 1) == []


def test_a_run_the_budget_cuts_short_fails_and_says_how_far_it_got(tmp_path: Path) -> None:
    # A Python that reports one GPU (this machine has none) and whose first step takes 6 s of
    # a 24 s budget: every later step finds under 20 s left and is recorded as not run.
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    'if [ "$1" = -c ] && [[ "$2" == *device_count* ]]; then echo 1; exit 0; fi\n'
                    'if [ "$2" = comm_backends.topology_report ]; then sleep 6; fi\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path), "BUDGET_S": "24"}
    run = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert run.returncode != 0 and "gpu_check: FAIL" in run.stdout, run.stdout
    assert summary["complete"] is True and summary["ok"] is False
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    assert list(statuses) == ["versions_topology", "serve_tp1", "gpu_marked_tests", "comm_tests",
                              "decode_table"]
    assert statuses["versions_topology"] in ("pass", "fail")
    assert all(statuses[name] == "not_run" for name in list(statuses)[1:]), statuses
