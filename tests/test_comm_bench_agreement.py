"""The allreduce benchmark's ranks agree on what they skip.

A backend's set-up is collective (shm's rendezvous, cuda_p2p's handle exchange): a rank that
refused one on its own would leave the others waiting in that set-up. Here rank 1 alone
refuses shm; both ranks must skip it, say which rank refused, and time gloo correctly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import comm_backends.shm as shm_module
from comm_backends.bench import BenchArgs, failures, run
from tests.test_comm_shm import run_world

REFUSAL = "allreduce backend 'shm' cannot run on this rank (test)"


def _bench_with_a_lone_refusal(rank: int, world: int) -> Any:
    if rank == 1:
        shm_module.ShmAllReduce.environment_refusal = classmethod(  # type: ignore[method-assign]
            lambda cls, device: REFUSAL)
    report = run(BenchArgs(backends=["gloo", "shm"], sizes=[4096], iters=5, warmup=1,
                           max_seconds=0.5))
    return report.skipped, [(r.backend, r.correct) for r in report.results], failures(report, [])


def test_a_backend_one_rank_refuses_is_skipped_on_every_rank(tmp_path: Path) -> None:
    results = run_world(2, _bench_with_a_lone_refusal, tmp_path)
    (skipped0, timed0, failed0), (skipped1, timed1, _) = results[0], results[1]
    assert skipped0 == {"shm": f"rank 1: {REFUSAL}"}
    assert skipped1 == {"shm": REFUSAL}
    assert timed0 == timed1 == [("gloo", True)]
    assert failed0 == [f"SKIPPED (required): shm: rank 1: {REFUSAL}"]
