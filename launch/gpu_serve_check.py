"""Start a real tpserve server, send one sampled and one greedy /generate request, stop it.

    python -m launch.gpu_serve_check --ranks 4 --allreduce cuda_p2p [--require cuda_p2p] [--json F]

Used by launch/gpu_check.sh once per backend (``--device cuda``, the built-in demo model);
runs on CPU too (``--device cpu``), which is how CI tests it. Each request is sent twice:
the sampled one (temperature 1, a fixed seed) and the greedy one must each repeat exactly.

Exit status: 0 passed; 1 failed (including a refusal of a backend in ``--require``, default
env REQUIRE); 3 the server refused the backend at start-up (one line, exit 2) and it was not
required: the gate records that as skipped, not passed.

Time: the whole check (start-up, requests, shutdown) fits in ``--budget`` seconds (default:
the gate's ``STEP_LIMIT`` less a margin, else 300), so it always writes its JSON and stops the
server itself before the gate's ``timeout -s KILL`` could. That matters at TP > 1: torchrun
starts every rank in a session of its own, so a kill of this script and of torchrun would
leave the ranks running, holding their GPUs and memory, and every later step would fail on
them. A server that is not healthy in time, or a request that does not come back in time (a
hung collective), is a failure, and the server's whole process tree is killed at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from launch.ports import free_port

REFUSED = 3
PORT_TRIES = 3
PROMPT = "def fib(n):"
DEFAULT_BUDGET_S = 300.0
GATE_MARGIN_S = 10.0  # kept back from the gate's STEP_LIMIT (interpreter start, JSON, exit)
STOP_RESERVE_S = 30.0  # kept back for stopping the server (graceful, then killed)


def command(ranks: int, port: int, ns: argparse.Namespace) -> list[str]:
    flags = ["-m", "tpserve", "--device", ns.device, "--port", str(port), "--allreduce",
             ns.allreduce, *ns.extra]
    if ranks == 1:
        return [sys.executable, *flags]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(ranks), *flags]


def default_budget() -> float:
    """The gate's limit for this step (``STEP_LIMIT``, set by gpu_check.sh) less a margin."""
    limit = os.environ.get("STEP_LIMIT")
    if not limit:
        return DEFAULT_BUDGET_S
    return max(1.0, float(limit) - GATE_MARGIN_S)


def left(deadline: float, cap: float | None = None) -> float:
    """Seconds until ``deadline`` (at least a little, at most ``cap``)."""
    remaining = max(0.5, deadline - time.monotonic())
    return remaining if cap is None else min(cap, remaining)


def wait_ready(url: str, proc: subprocess.Popen, deadline: float) -> bool:
    """True once /health is 200; False if the server exited first."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url + "/health", timeout=left(deadline, 2)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy within the limit at {url}")


def generate(url: str, temperature: float, deadline: float) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": 32, "temperature": temperature,
                              "ignore_eos": True}
    if temperature > 0:
        params["seed"] = 7
    start = time.perf_counter()
    reply = httpx.post(url + "/generate", json={"text": PROMPT, "sampling_params": params},
                       timeout=left(deadline))
    reply.raise_for_status()
    body = reply.json()
    return {"output_ids": body["output_ids"], "seconds": time.perf_counter() - start}


def exercise(url: str, deadline: float) -> dict[str, Any]:
    """Each request twice; failures are listed, not raised, so the JSON shows all of them.
    A request that fails or does not come back by ``deadline`` ends the exercise."""
    result: dict[str, Any] = {"problems": []}
    try:
        for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
            first = generate(url, temperature, deadline)
            second = generate(url, temperature, deadline)
            result[name] = first
            if len(first["output_ids"]) != 32:
                result["problems"].append(f"{name}: {len(first['output_ids'])} tokens, expected 32")
            if first["output_ids"] != second["output_ids"]:
                result["problems"].append(f"{name}: the same request gave a different output")
        info = httpx.get(url + "/get_server_info", timeout=left(deadline, 30)).json()
        result["active"] = info.get("active")
    except httpx.HTTPError as exc:  # a timeout too: a hung step never answers
        result["problems"].append(f"request failed: {type(exc).__name__}: {exc}")
    return result


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the server and everything under it. torchrun's ranks run in sessions of their
    own, so neither the gate's ``timeout -s KILL`` nor a kill of torchrun reaches them: they
    are found through /proc (before anything is killed, while they are still its children)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def stop(proc: subprocess.Popen, grace: float = 60) -> int:
    """SIGTERM (torchrun forwards it to every rank) and up to ``grace`` seconds for a clean
    exit, then SIGKILL to the whole tree; ``grace`` 0 kills it at once (a failed server)."""
    if proc.poll() is None:
        if grace > 0:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
        else:
            kill_tree(proc)
    return proc.returncode


def refusals(log: str, allreduce: str, ranks: int) -> list[str]:
    """The start-up lines that refuse the allreduce backend (every ``BackendUnavailable``
    names one: "allreduce backend ..." or "no allreduce backend ..."). Any other error a
    server exits with (the KV budget, the attention backend, a bad flag) is a failure, not
    a refusal, and ``auto`` on one rank must always start."""
    if allreduce == "auto" and ranks == 1:
        return []
    return [line for line in log.splitlines()
            if line.startswith("error: ") and "allreduce backend" in line]


def run(ns: argparse.Namespace, log: Path, end: float) -> tuple[int, dict[str, Any]]:
    """One server start and check, all of it (the stop included) before ``end``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    work_by = end - min(STOP_RESERVE_S, (end - time.monotonic()) / 4)
    ready_by = work_by if ns.timeout is None else min(work_by, time.monotonic() + ns.timeout)
    with open(log, "w") as out:
        proc = subprocess.Popen(command(ns.ranks, port, ns), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    grace = 0.0  # anything but a completed exercise kills the server at once
    try:
        try:
            ready = wait_ready(url, proc, ready_by)
        except TimeoutError as exc:
            return 1, {"error": str(exc), "log": log.read_text()[-3000:]}
        if not ready:
            refusal = refusals(log.read_text(), ns.allreduce, ns.ranks)
            if proc.returncode not in (0, None) and refusal:
                required = ns.allreduce in ns.require
                return (1 if required else REFUSED), {"refused": refusal[-1], "required": required}
            return 1, {"error": f"server exited with {proc.returncode}", "log": log.read_text()[-3000:]}
        result = exercise(url, work_by)
        if not result["problems"]:
            grace = max(1.0, end - time.monotonic() - 5)
    finally:
        code = stop(proc, min(60.0, grace))
    result["exit_code"] = code
    if result["problems"]:
        result["log"] = log.read_text()[-3000:]
    return (1 if result["problems"] else 0), result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.gpu_serve_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--allreduce", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--require", default=os.environ.get("REQUIRE", ""))
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to become healthy (default: what the budget leaves)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check, the stop included (default: the gate's "
                        "STEP_LIMIT less a margin, else 300)")
    p.add_argument("--json", default=None)
    p.add_argument("--log", default=None, help="server log (default: a temporary file)")
    p.add_argument("extra", nargs="*", help="more tpserve flags (after --)")
    ns = p.parse_args(argv)
    ns.require = {n.strip() for n in ns.require.split(",") if n.strip()}
    log = Path(ns.log) if ns.log else Path(tempfile.mkdtemp(prefix="tpserve-check-")) / "server.log"
    end = time.monotonic() + (ns.budget if ns.budget is not None else default_budget())
    for _ in range(PORT_TRIES):
        code, result = run(ns, log, end)
        # A port free_port() saw free but another process's connection took before the server
        # bound it: a new port, not a failed check (one device run is all a GPU session gets).
        if "error" not in result or "address already in use" not in result.get("log", "").lower():
            break
    result.update(ranks=ns.ranks, allreduce=ns.allreduce, device=ns.device, status=code)
    print(json.dumps(result))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
