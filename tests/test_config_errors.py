"""A configuration refusal is one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import free_port


@pytest.mark.parametrize("flags,message", [
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm 'MEDUSA' is not supported"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--allreduce", "nccl"], "nccl"),
])
def test_refusal_is_one_line_and_exit_code_2(flags: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tpserve", "--device", "cpu", "--port", str(free_port()),
         "--log-level", "warning", *flags],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr
