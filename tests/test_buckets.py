"""Bucket selection and inert padding: padded requests never change the real rows' attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpserve.engine.buckets import Buckets, default_batch_sizes, inert_batch, pad_forward_batch
from tpserve.engine.plan import Layout, build_forward_batch
from tpserve.layers.attention import AttentionSpec, bind, create

CPU = torch.device("cpu")


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(32) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert default_batch_sizes(20) == (1, 2, 4, 8, 12, 16, 20)  # max_bs itself is a bucket
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(512)[-3:] == (480, 496, 512)


def test_pick() -> None:
    b = Buckets((1, 2, 4, 8))
    assert b.pick(3) == 4 and b.pick(1) == 1 and b.pick(8) == 8
    assert b.pick(9) is None


def _layout(batch: int, queries: int) -> Layout:
    rng = np.random.default_rng(0)
    cached = rng.integers(0, 20, batch).astype(np.int32)
    pages = np.stack([rng.permutation(np.arange(1, 40))[:8] for _ in range(batch)])
    tokens = rng.integers(1, 50, batch * queries)
    return Layout(tokens, np.full(batch, queries, dtype=np.int32), cached, pages.astype(np.int32))


def _attend(fb, cache) -> torch.Tensor:  # type: ignore[no-untyped-def]
    backend = create("torch", AttentionSpec(4, 2, 8, 0.3, torch.float32), CPU)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(64, 4, 8, generator=g)[: fb.num_rows]
    kv = torch.randn(64, 2, 8, generator=g)[: fb.num_rows]
    return bind(backend, fb.attn)(q, kv, kv.clone(), cache)


@pytest.mark.parametrize("queries", [1, 3])
def test_padding_keeps_real_rows_and_touches_only_the_dummy_page(queries: int) -> None:
    fb = build_forward_batch(_layout(3, queries), 4, CPU)
    assert fb.queries == queries
    padded = pad_forward_batch(fb, 8)
    assert padded.batch_size == 8 and padded.num_rows == 8 * queries
    assert torch.equal(padded.input_ids[: 3 * queries], fb.input_ids)
    cache_a = tuple(torch.randn(40 * 4, 2, 8) for _ in range(2))
    cache_b = tuple(t.clone() for t in cache_a)
    real = _attend(fb, cache_a)
    out = _attend(padded, cache_b)
    assert torch.allclose(out[: 3 * queries], real, atol=1e-6) and torch.isfinite(out).all()
    # Inert requests wrote only to the dummy page 0 (slots 0..page_size-1).
    for a, b in zip(cache_a, cache_b, strict=True):
        assert torch.equal(a[4:], b[4:])
    assert pad_forward_batch(fb, 3) is fb
    with pytest.raises(ValueError):
        pad_forward_batch(fb, 2)


def test_inert_batch() -> None:
    fb = inert_batch(2, 3, 5, 4, CPU, masked_keys=6)
    assert fb.queries == 3 and fb.batch_size == 2
    assert fb.attn.page_table.shape == (2, 5) and not fb.attn.page_table.any()
    assert (fb.attn.write_slots < 4).all() and fb.attn.custom_mask.shape == (2, 3, 6)
