"""Several nodes on one machine: node identity is torchrun's GROUP_RANK, set per process here.

Checks that single-node backends refuse to span nodes in one line, that ``auto`` picks
``hier``, that ``hier`` matches the float64 reference with the same bits on every rank and
times its three parts, and that the control channel relays through node leaders and tells
rank 0 when a rank of another node dies.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm_backends
from comm_backends.base import BackendUnavailable
from comm_backends.shm import ShmAllReduce
from tests.test_comm_shm import DTYPES, _assert_same_everywhere, _check_case, run_world

SHAPES = ((1,), (7,), (4096,), (3, 1001), (70_001,))


def _as_node(rank: int, layout: tuple[int, ...]) -> None:
    """Pretend to be a rank of node ``layout[rank]`` (what torchrun's env says)."""
    node = layout[rank]
    os.environ.update(GROUP_RANK=str(node), LOCAL_WORLD_SIZE=str(layout.count(node)))


def _scenario_hier(rank: int, world: int, layout: tuple[int, ...]) -> dict[str, Any]:
    _as_node(rank, layout)
    cpu = torch.device("cpu")
    with pytest.raises(BackendUnavailable) as refused:
        ShmAllReduce(None, cpu)
    assert "\n" not in str(refused.value)
    backend = comm_backends.create("hier", None, cpu)
    digests = [_check_case(backend, shape, dtype, 31 * i + 5)
               for i, shape in enumerate(SHAPES) for dtype in DTYPES]
    _assert_same_everywhere(digests)
    parts = {k: v["calls"] for k, v in backend.stats.snapshot().get("parts", {}).items()}
    gathered = backend.all_gather(torch.full((2, 3), float(rank)))
    assert torch.equal(gathered, torch.cat([torch.full((2, 3), float(r)) for r in range(world)], -1))
    assert backend.capture_safe is False  # shm and gloo cannot be captured
    backend.close()
    return {"parts": parts, "leader": backend.is_leader, "calls": len(digests),
            "choice": comm_backends.choose(comm_backends.measure_here(cpu)).name,
            "shm": str(refused.value)}


@pytest.mark.parametrize("layout", [(0, 0, 1, 1), (0, 0, 1)])
def test_hier_matches_reference_across_nodes(layout: tuple[int, ...], tmp_path: Path) -> None:
    results = run_world(len(layout), _scenario_hier, tmp_path, layout=layout)
    calls = results[0]["calls"]
    assert results[0]["choice"] == "hier"  # rank 0's view decides for everyone (create_comm)
    for rank, r in results.items():
        assert "works within one node" in r["shm"] and "span 2 nodes" in r["shm"]
        assert r["leader"] == (rank in (0, 2))
        alone = layout.count(layout[rank]) == 1
        # Leaders time the cross-node part; ranks sharing a node time both local parts.
        expected = ({} if alone else {"local": calls, "broadcast": calls})
        if r["leader"]:
            expected["cross"] = calls
        assert r["parts"] == expected, (rank, r["parts"])


def test_shm_refuses_several_nodes_before_set_up() -> None:
    topo = comm_backends.Topology("cpu", 4, 2, nodes=2)
    assert "spans 2 nodes" in comm_backends.refusal("shm", topo)
    assert comm_backends.refusal("hier", topo) is None


# ---------------------------------------------------------------------------- control channel
def _scenario_relay(rank: int, world: int, layout: tuple[int, ...], victim: int) -> dict[str, Any]:
    from tpserve.control import make_channel
    from tpserve.control_nodes import NodeRelayChannel

    _as_node(rank, layout)
    deaths: list[str] = []
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, os.environ["GROUP_RANK"])
    channel = NodeRelayChannel(None, keys, on_death=deaths.append)
    assert type(make_channel(None)).__name__ == "NodeRelayChannel"  # what the server builds
    plans = [{"step": i, "blob": bytes(range(256)) * i} for i in range(20)]
    got = []
    for plan in plans:
        if rank == 0:
            channel.send(plan)
        else:
            got.append(channel.recv())
    assert rank == 0 or got == plans
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank != 0:
        time.sleep(2)
        return {}
    start = time.monotonic()
    while channel.dead_peer() is None and time.monotonic() - start < 20:
        time.sleep(0.05)
    return {"dead": channel.dead_peer(), "deaths": deaths, "seconds": time.monotonic() - start,
            "peer_pids": len(channel.peer_pids)}


@pytest.mark.parametrize("victim", [1, 2, 3])
def test_relay_delivers_and_rank0_learns_any_death(victim: int, tmp_path: Path) -> None:
    result = run_world(4, _scenario_relay, tmp_path, reports=3, layout=(0, 0, 1, 1), victim=victim)[0]
    assert result["peer_pids"] == 2  # the watchdog checks only pids of rank 0's own node
    assert result["dead"] is not None and f"rank {victim}" in result["dead"], result
    assert result["seconds"] < 5
    if victim != 1:  # another node's rank: reported through its connection, once
        assert result["deaths"] == [result["dead"]]


def _scenario_relay_clean(rank: int, world: int, layout: tuple[int, ...]) -> str | None:
    from tpserve.control_nodes import NodeRelayChannel

    _as_node(rank, layout)
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, os.environ["GROUP_RANK"])
    channel = NodeRelayChannel(None, keys, on_death=lambda why: None)
    if rank == 0:
        channel.send("shutdown")
    else:
        assert channel.recv() == "shutdown"
        channel.close()  # a clean exit says bye
    dist.barrier()
    time.sleep(0.5)
    dead = channel.dead_peer() if rank == 0 else None
    if rank == 0:
        channel.close()
    return dead


def test_clean_exits_are_not_deaths(tmp_path: Path) -> None:
    assert run_world(4, _scenario_relay_clean, tmp_path, layout=(0, 1, 1, 2))[0] is None


# ---------------------------------------------------------------------------- the benchmark
def _scenario_bench(rank: int, world: int, layout: tuple[int, ...]) -> Any:
    from comm_backends.bench import BenchArgs, failures, run

    _as_node(rank, layout)
    report = run(BenchArgs(backends=["gloo", "hier", "shm"], sizes=[4096, 65536], iters=10,
                           warmup=2, max_seconds=0.5))
    return report, failures(report, []), failures(report, ["shm"])


def test_bench_across_nodes_compares_hier_with_flat_and_fails_on_a_skip(tmp_path: Path) -> None:
    from comm_backends.bench_report import render_table

    report, strict, lenient = run_world(4, _scenario_bench, tmp_path, layout=(0, 0, 1, 1))[0]
    assert {(r.backend, r.nbytes) for r in report.results} == {
        (b, n) for b in ("gloo", "hier") for n in (4096, 65536)}
    assert all(r.correct for r in report.results)
    hier = [r for r in report.results if r.backend == "hier"]
    assert all(set(r.parts_us) == {"local", "cross", "broadcast"} for r in hier)
    assert "spans 2 nodes" in report.skipped["shm"]
    assert strict == [f"SKIPPED (required): shm: {report.skipped['shm']}"] and lenient == []
    table = render_table(report)
    assert "x gloo" in table and "hier at 4K, us per call (rank 0): local" in table


class _Part:
    def __init__(self, safe: bool) -> None:
        self.capture_safe = safe


@pytest.mark.parametrize(("local", "cross", "safe"), [
    (True, True, True),  # cuda_p2p / symm_mem / nccl within the node, NCCL across nodes
    (True, None, True),  # one node: the local part alone
    (None, True, True),  # a rank alone on its node, a leader
    (True, False, False),
    (False, None, False),  # shm on CPU
])
def test_hier_is_capture_safe_exactly_when_its_parts_are(
        monkeypatch: pytest.MonkeyPatch, local: bool | None, cross: bool | None,
        safe: bool) -> None:
    import comm_backends.base as base
    from comm_backends.hier import HierAllReduce

    monkeypatch.setattr(base.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(base.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(base.dist, "get_world_size", lambda group=None: 4)

    def setup(self: HierAllReduce) -> None:
        self._local = None if local is None else _Part(local)  # type: ignore[assignment]
        self._cross = None if cross is None else _Part(cross)  # type: ignore[assignment]

    monkeypatch.setattr(HierAllReduce, "_setup", setup)
    assert HierAllReduce(None, torch.device("cpu")).capture_safe is safe
    assert HierAllReduce.capture_safe is False  # the class alone promises nothing
