"""Default torch (and gemm pool) threads per rank on CPU: the cores split between the ranks."""

from __future__ import annotations

import pytest

from tpserve.dist import cpu_threads_per_rank


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
