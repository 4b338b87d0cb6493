"""Bucket selection and inert padding: padded batches attend to exactly the same keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpserve.engine.buckets import (
    Buckets,
    default_batch_sizes,
    pad_forward_batch,
    power_of_two_keys,
)
from tpserve.engine.compiled import inert_batch
from tpserve.engine.plan import Layout, build_forward_batch


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(32) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert default_batch_sizes(20) == (1, 2, 4, 8, 12, 16, 20)  # max_bs itself is a bucket
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(512)[-3:] == (480, 496, 512)


def test_key_buckets_and_pick() -> None:
    keys = power_of_two_keys(1000, 16)
    assert keys == (64, 128, 256, 512, 1008)
    assert all(k % 16 == 0 for k in keys)
    b = Buckets((1, 2, 4, 8), keys)
    assert b.pick(3, 80) == (4, 128)
    assert b.pick(1, 16) == (1, 64)
    assert b.pick(8, 1008) == (8, 1008)
    assert b.pick(9, 16) is None and b.pick(1, 1009) is None


def _plan(batch: int, queries: int) -> Layout:
    rng = np.random.default_rng(0)
    cached = rng.integers(0, 20, batch).astype(np.int32)
    q_lens = rng.integers(1, queries + 1, batch).astype(np.int32)
    pages = np.stack([rng.permutation(np.arange(1, 40))[:8] for _ in range(batch)])
    tokens = rng.integers(1, 50, (batch, queries))
    return Layout(tokens, q_lens, cached, pages.astype(np.int32))


@pytest.mark.parametrize("queries", [1, 3])
def test_pad_forward_batch_is_inert(queries: int) -> None:
    fb = build_forward_batch(_plan(3, queries), 4, None, torch.device("cpu"))
    b, t = fb.read_slots.shape
    padded = pad_forward_batch(fb, 8, t + 12)
    assert padded.input_ids.shape == (8, queries) and padded.mask.shape == (8, 1, queries, t + 12)
    # Real rows: unchanged, and no padded key is visible.
    assert torch.equal(padded.mask[:b, :, :, :t], fb.mask)
    assert not padded.mask[:b, :, :, t:].any()
    assert torch.equal(padded.read_slots[:b, :t], fb.read_slots)
    assert torch.equal(padded.write_slots[:b], fb.write_slots)
    # Inert rows: write slot 0, read slot 0, see only key 0.
    assert not padded.write_slots[b:].any() and not padded.read_slots[b:].any()
    assert padded.mask[b:, :, :, 0].all() and not padded.mask[b:, :, :, 1:].any()
    assert pad_forward_batch(fb, b, t) is fb
    with pytest.raises(ValueError):
        pad_forward_batch(fb, b - 1, t)


def test_inert_batch() -> None:
    fb = inert_batch(2, 3, 16, torch.device("cpu"))
    assert fb.mask[..., 0].all() and not fb.mask[..., 1:].any()
    assert not fb.write_slots.any() and not fb.read_slots.any()
