"""The step layout's rotary positions: the small-batch Python path equals the numpy one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpserve.engine.plan import Layout, build_forward_batch, causal_positions, row_offsets
from tpserve.layers.attention.metadata import SMALL_ROWS


@pytest.mark.parametrize("batch,max_q", [(1, 1), (7, 5), (16, 1), (SMALL_ROWS, 1), (30, 9),
                                         (SMALL_ROWS + 3, 2)])
def test_positions_follow_each_requests_cache(batch: int, max_q: int) -> None:
    gen = np.random.default_rng(batch * 100 + max_q)
    q = gen.integers(0, max_q + 1, batch)
    cached = gen.integers(0, 500, batch)
    expected = [int(c) + j for c, n in zip(cached, q, strict=True) for j in range(n)]
    got = causal_positions(q, cached)
    assert got.dtype == np.int64 and got.tolist() == expected
    assert (np.repeat(cached, q) + row_offsets(q)).tolist() == expected


def test_forward_batch_of_a_decode_step() -> None:
    layout = Layout(np.array([5, 9, 2], dtype=np.int64), np.ones(3, dtype=np.int32),
                    np.array([0, 17, 40], dtype=np.int32),
                    np.array([[1, 0, 0], [2, 3, 0], [4, 5, 6]], dtype=np.int32))
    fb = build_forward_batch(layout, 16, torch.device("cpu"))
    assert fb.positions.tolist() == [0, 17, 40] and fb.input_ids.tolist() == [5, 9, 2]
    assert fb.queries == 1 and fb.attn.uniform_q_len == 1
    assert fb.attn.write_slots.tolist() == [16, 3 * 16 + 1, 6 * 16 + 8]
    ragged = Layout(np.arange(4, dtype=np.int64), np.array([1, 3], dtype=np.int32),
                    np.array([3, 0], dtype=np.int32), np.array([[1], [2]], dtype=np.int32))
    fb = build_forward_batch(ragged, 16, torch.device("cpu"))
    assert fb.positions.tolist() == [3, 0, 1, 2] and fb.queries == 0
