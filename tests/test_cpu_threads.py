"""Default torch (and gemm pool) threads per rank on CPU: the cores split between the ranks."""

from __future__ import annotations

import pytest
import torch

from tpserve.dist import cpu_threads_per_rank
from tpserve.engine.step_threads import StepThreads
from tpserve.layers import cpu_ops
from tpserve.layers.attention import cpu_native


@pytest.mark.parametrize(("cores", "ranks", "expected"), [
    (2, 1, 2),    # TP = 1 on the 2-core CI machine: both cores (HTTP shares one)
    (16, 1, 16),
    (1, 1, 1),    # never zero
    (2, 2, 1),
    (16, 2, 8),
    (4, 8, 1),    # more ranks than cores: one each
])
def test_default_split(cores: int, ranks: int, expected: int) -> None:
    assert cpu_threads_per_rank(ranks, None, cores) == expected


def test_override_wins() -> None:
    assert cpu_threads_per_rank(1, 6, cores=2) == 6


def test_steps_of_a_few_tokens_run_torch_on_one_thread() -> None:
    """Decode-sized steps leave OpenMP alone (one thread); prefill-sized ones use the share."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        threads = StepThreads.for_device(torch.device("cpu"))
        assert threads.full == 3 and threads.small_tokens >= 8
        threads.fit(1)
        assert torch.get_num_threads() == 1
        threads.fit(threads.small_tokens)
        assert torch.get_num_threads() == 1
        threads.fit(threads.small_tokens + 1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_step_threads_leave_other_devices_and_one_thread_alone() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gpu = StepThreads.for_device(torch.device("cuda"))
        assert gpu.threads_for(1) == 2
        torch.set_num_threads(1)
        assert StepThreads.for_device(torch.device("cpu")).small_tokens == 0
    finally:
        torch.set_num_threads(before)


def test_native_attention_runs_on_the_matmul_pool() -> None:
    """With the C++ ops built, attention shares tpserve::matmul's threads (no OpenMP region)."""
    if cpu_ops.load().impl != "c++" or cpu_native.load().reason:
        pytest.skip("native ops unavailable here")
    assert cpu_native.load().threaded
    assert torch.ops.tpserve.pool_handle() != 0
