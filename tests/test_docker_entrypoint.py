"""docker/entrypoint.sh outside Docker: the torchrun command each environment produces.

Most cases use the dry run (TPSERVE_ENTRYPOINT_DRY_RUN=1 prints the command, shell-quoted);
one checks that the real exec runs exactly that command, and one starts the demo server
through the script and stops it with SIGTERM, as ``docker stop`` would.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import free_port
from tests.server_proc import stop, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docker" / "entrypoint.sh"
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
# The images run it as /bin/sh (dash on Debian and Ubuntu); bash must agree.
SHELLS = [s for s in ("dash", "bash") if shutil.which(s)]


@pytest.fixture(params=SHELLS)
def shell(request: pytest.FixtureRequest) -> str:
    return request.param


def fake_tool(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def run_script(shell: str, env: dict[str, str], *args: str, bindir: Path | None = None,
               dry: bool = True) -> subprocess.CompletedProcess:
    """The script under a clean environment: PATH holds only ``bindir`` and the system dirs,
    so a developer's nvidia-smi or CUDA_VISIBLE_DEVICES cannot leak in."""
    path = ([str(bindir)] if bindir else []) + ["/usr/bin", "/bin"]
    full = {"PATH": os.pathsep.join(path), **env}
    if dry:
        full["TPSERVE_ENTRYPOINT_DRY_RUN"] = "1"
    return subprocess.run([shell, str(SCRIPT), *args], env=full, capture_output=True,
                          text=True, timeout=30)


def command(shell: str, env: dict[str, str], *args: str, bindir: Path | None = None) -> list[str]:
    out = run_script(shell, env, *args, bindir=bindir)
    assert out.returncode == 0, out.stderr
    return shlex.split(out.stdout)


def single_node(nproc: int, *args: str) -> list[str]:
    return ["torchrun", "--standalone", "--nproc-per-node", str(nproc), "-m", "tpserve", *args]


def test_defaults_to_one_rank_without_gpus(shell: str, tmp_path: Path) -> None:
    assert command(shell, {}, bindir=tmp_path) == single_node(1)


def test_arguments_reach_tpserve_verbatim(shell: str) -> None:
    args = ("--host", "0.0.0.0", "--model", "/models/a b/it's", "--stop", "", "--x=$HOME")
    assert command(shell, {}, *args) == single_node(1, *args)


def test_nproc_from_environment(shell: str) -> None:
    assert command(shell, {"TPSERVE_NPROC": "4"}, "--port", "8000") == \
        single_node(4, "--port", "8000")


@pytest.mark.parametrize("visible, nproc", [("0,2,3", 3), ("1", 1), ("", 1),
                                            ("GPU-1a2b,GPU-3c4d", 2)])
def test_nproc_counts_cuda_visible_devices(shell: str, visible: str, nproc: int) -> None:
    assert command(shell, {"CUDA_VISIBLE_DEVICES": visible}) == single_node(nproc)


def test_nproc_counts_the_gpus_nvidia_smi_lists(shell: str, tmp_path: Path) -> None:
    listing = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})\\n" for i in range(8))
    listing += "  MIG 1g.10gb     Device  0: (UUID: MIG-GPU-0/1/0)\\n"
    fake_tool(tmp_path, "nvidia-smi", f'[ "$1" = "-L" ] && printf "{listing}"\n')
    assert command(shell, {}, bindir=tmp_path) == single_node(8)
    # An explicit setting wins over the count, and CUDA_VISIBLE_DEVICES over nvidia-smi.
    assert command(shell, {"TPSERVE_NPROC": "2"}, bindir=tmp_path) == single_node(2)
    assert command(shell, {"CUDA_VISIBLE_DEVICES": "5"}, bindir=tmp_path) == single_node(1)


def test_failing_nvidia_smi_means_cpu(shell: str, tmp_path: Path) -> None:
    fake_tool(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2; exit 9\n")
    assert command(shell, {}, bindir=tmp_path) == single_node(1)


def test_multi_node_uses_c10d_rendezvous(shell: str) -> None:
    env = {"TPSERVE_NPROC": "4", "NNODES": "2", "NODE_RANK": "1",
           "RDZV_ENDPOINT": "node0.example:29500", "RDZV_ID": "job 7"}
    assert command(shell, env, "--allreduce", "nccl") == [
        "torchrun", "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0.example:29500", "--rdzv-id", "job 7",
        "--nproc-per-node", "4", "-m", "tpserve", "--allreduce", "nccl"]


def test_node_rank_defaults_to_zero_and_ipv6_endpoint(shell: str) -> None:
    env = {"TPSERVE_NPROC": "2", "NNODES": "3", "RDZV_ENDPOINT": "[fd00::1]:29400"}
    assert command(shell, env) == [
        "torchrun", "--nnodes", "3", "--node-rank", "0", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "[fd00::1]:29400", "--nproc-per-node", "2", "-m", "tpserve"]


def test_another_module_under_torchrun(shell: str) -> None:
    env = {"TPSERVE_NPROC": "2", "TPSERVE_MODULE": "comm_backends.bench"}
    assert command(shell, env, "--backends", "gloo,shm") == [
        "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "comm_backends.bench",
        "--backends", "gloo,shm"]


def test_a_command_runs_instead_of_the_server(shell: str) -> None:
    assert command(shell, {"TPSERVE_NPROC": "2"}, "python", "-c", "print('x y')") == \
        ["python", "-c", "print('x y')"]


@pytest.mark.parametrize("env, message", [
    ({"TPSERVE_NPROC": "0"}, "TPSERVE_NPROC must be a positive integer, got '0'"),
    ({"TPSERVE_NPROC": "gpu"}, "TPSERVE_NPROC must be a positive integer, got 'gpu'"),
    ({"NNODES": "two"}, "NNODES must be a positive integer, got 'two'"),
    ({"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT=HOST:PORT"),
    ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"},
     "NODE_RANK must be an integer in 0..1, got '2'"),
    ({"NODE_RANK": "-1"}, "NODE_RANK must be an integer in 0..0, got '-1'"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT must be HOST:PORT, got 'node0'"),
])
def test_bad_settings_exit_2_with_one_line(shell: str, env: dict[str, str], message: str) -> None:
    out = run_script(shell, env, "--port", "1")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("tpserve-entrypoint: error: " + message)
    assert out.stderr.count("\n") == 1


def test_exec_runs_exactly_the_dry_run_command(shell: str, tmp_path: Path) -> None:
    record = tmp_path / "argv.json"
    fake_tool(tmp_path, "torchrun",
              f'exec {shlex.quote(sys.executable)} -c "import json, sys; '
              f"json.dump(sys.argv[1:], open('{record}', 'w'))\" \"$@\"\n")
    env = {"TPSERVE_NPROC": "3", "NNODES": "2", "RDZV_ENDPOINT": "h:29500"}
    args = ("--model", "/m/it's here", "")
    planned = command(shell, env, *args, bindir=tmp_path)
    out = run_script(shell, env, *args, bindir=tmp_path, dry=False)
    assert out.returncode == 0, out.stderr
    assert ["torchrun", *json.loads(record.read_text())] == planned


def group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_serves_the_demo_model_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The real thing at TP = 1 on CPU, with an API key from the environment as the documented
    run lines pass it: /health turns 200 (it needs no key, so the image's healthcheck works),
    other paths want the key, and SIGTERM to the exec'd torchrun (PID 1's child in a
    container) ends every process."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The native-build cache is inherited (keyed by source hash, so sharing it is safe): a
    # fresh one would add the ~10 s C++ build to a test about the launcher.
    env = {**os.environ, "TPSERVE_NPROC": "1", "TPSERVE_API_KEY": "sesame",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["sh", str(SCRIPT), "--device", "cpu", "--port", str(port),
                                 "--kv-cache-gb", "0.05", "--context-length", "256",
                                 "--skip-server-warmup"],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_healthy(url, proc, 120, log_path)
            check = [sys.executable, str(HEALTHCHECK), "--", "--port", str(port)]
            assert subprocess.run(check, capture_output=True, timeout=30).returncode == 0
            assert httpx.get(url + "/get_model_info", timeout=10).status_code == 401
            authorized = {"Authorization": "Bearer sesame"}
            assert httpx.get(url + "/get_model_info", headers=authorized, timeout=10).is_success
            proc.send_signal(signal.SIGTERM)  # the exec'd torchrun, not a shell around it
            proc.wait(timeout=45)
            text = log_path.read_text()
            # torchrun forwards the signal, then re-raises it: its own exit code is 1.
            assert proc.returncode == 1, text[-3000:]
            assert "signal SIGTERM: stopping" in text and "exiting with code 0" in text
            assert group_gone(proc.pid, 10), "a process of the job outlived torchrun"
            assert subprocess.run(check, capture_output=True, timeout=30).returncode == 1
        finally:
            stop(proc)
