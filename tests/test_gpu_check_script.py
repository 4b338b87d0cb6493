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
