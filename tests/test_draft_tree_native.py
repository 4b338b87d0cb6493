"""The EAGLE-3 draft's tree loop as one native call (``draft_tree.cpp``) against the eager loop.

Same draft, same root output, same page table and starting draft KV: the proposed tree
(tokens, parents, depths, masks) and every draft KV entry the loop writes for its temporary
nodes must equal the eager loop's bit for bit, for chains and trees, one request and a batch
with fragmented pages, 16/32-bit dtypes and head_dim 16 and 32 (the narrow and the wide
attention op on AVX-512). The engine test checks the speculative server uses it and stays
token-identical to plain decoding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tpserve.engine.plan import Layout, build_forward_batch
from tpserve.layers import cpu_ops
from tpserve.layers.attention import cpu_native
from tpserve.layers.tp import TPContext
from tpserve.layers.vocab import VocabParallelEmbedding
from tpserve.spec.config import SpecConfig
from tpserve.spec.eagle import can_grow_natively, draft_tree, grow_natively

CPU = torch.device("cpu")
VOCAB = 96
PAGE = 4


def _native_or_skip() -> None:
    if cpu_ops.load().impl != "c++":
        pytest.skip(f"C++ ops not built here: {cpu_ops.load().reason}")
    if cpu_native.load().reason:
        pytest.skip(f"native CPU attention unavailable: {cpu_native.load().reason}")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("drafts")
    out = {}
    for hidden in (64, 128):
        target = make_checkpoint(root / f"t{hidden}", "llama", hidden=hidden, layers=4,
                                 vocab=VOCAB)
        out[hidden] = make_draft(root / f"d{hidden}", target)
    return out


def _pages(committed: list[int], nodes: int, rng: np.random.Generator) -> np.ndarray:
    """A shuffled (fragmented) page table covering committed + nodes entries per request."""
    need = [-(-(c + nodes) // PAGE) for c in committed]
    ids = rng.permutation(np.arange(1, sum(need) + 1)).astype(np.int32)
    table = np.zeros((len(committed), max(need) + 1), dtype=np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = ids[at : at + n]
        at += n
    return table


@pytest.mark.parametrize("hidden", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4, 1, 5), (4, 2, 8), (3, 3, 9)])
@pytest.mark.parametrize("committed", [[7], [5, 13]])
def test_native_tree_equals_the_eager_loop(drafts: dict[int, Path], hidden: int,
                                           dtype: torch.dtype, shape: tuple[int, int, int],
                                           committed: list[int]) -> None:
    _native_or_skip()
    from tpserve.models.eagle3 import build_eagle3, load_eagle3_config

    cfg = SpecConfig(*shape)
    draft_cfg = load_eagle3_config(drafts[hidden])
    draft = build_eagle3(drafts[hidden], draft_cfg, TPContext.single(), dtype, CPU, 256)
    assert draft.blocks is not None, draft.blocks_reason
    gen = torch.Generator().manual_seed(hidden + len(committed))
    embed = VocabParallelEmbedding(VOCAB, hidden, TPContext.single(), dtype, CPU)
    embed.weight.data.copy_(torch.randn(VOCAB, hidden, generator=gen).to(dtype))
    batch = len(committed)
    start = torch.randn(batch, hidden, generator=gen).to(dtype)
    roots = torch.randint(0, VOCAB, (batch,), generator=gen)
    rng = np.random.default_rng(hidden)
    table = _pages(committed, cfg.num_steps * cfg.topk, rng)
    attn = draft.self_attn
    slots = (int(table.max()) + 1) * PAGE
    k0 = torch.randn(slots, attn.kv_heads, attn.head_dim, generator=gen).to(dtype)
    v0 = torch.randn(slots, attn.kv_heads, attn.head_dim, generator=gen).to(dtype)
    pages = torch.from_numpy(table).long()
    done = torch.tensor(committed, dtype=torch.long)
    assert can_grow_natively(draft, embed, CPU)
    trees, caches = [], []
    for native in (True, False):
        cache = (k0.clone(), v0.clone())
        with torch.inference_mode():
            trees.append(draft_tree(draft, embed, cache, start, roots, pages, done, cfg, PAGE,
                                    native=native))
        caches.append(cache)
    fast, slow = trees
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not torch.equal(caches[0][0], k0)  # the temporary nodes' KV really was written
    assert fast.tokens.shape == (batch, cfg.num_draft_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pending", [[1], [4], [3, 1], [2, 5]])
def test_native_extend_then_tree_equals_the_python_path(drafts: dict[int, Path],
                                                        dtype: torch.dtype,
                                                        pending: list[int]) -> None:
    """With the draft extend inside the call (the pending rows of a speculative step): the
    same tree and the same draft KV (committed rows and temporary nodes) as the Python extend
    (drafter.py's _draft_extend) followed by the eager loop."""
    _native_or_skip()
    from tpserve.models.eagle3 import build_eagle3, load_eagle3_config

    hidden, cfg = 64, SpecConfig(3, 2, 6)
    draft = build_eagle3(drafts[hidden], load_eagle3_config(drafts[hidden]),
                         TPContext.single(), dtype, CPU, 256)
    gen = torch.Generator().manual_seed(sum(pending))
    embed = VocabParallelEmbedding(VOCAB, hidden, TPContext.single(), dtype, CPU)
    embed.weight.data.copy_(torch.randn(VOCAB, hidden, generator=gen).to(dtype))
    batch = len(pending)
    starts = [6 + 5 * b for b in range(batch)]  # the pending rows go at draft KV starts + j
    committed = [s + n for s, n in zip(starts, pending, strict=True)]
    table = _pages(committed, cfg.num_steps * cfg.topk, np.random.default_rng(batch))
    attn = draft.self_attn
    slots = (int(table.max()) + 1) * PAGE
    k0 = torch.randn(slots, attn.kv_heads, attn.head_dim, generator=gen).to(dtype)
    v0 = torch.randn(slots, attn.kv_heads, attn.head_dim, generator=gen).to(dtype)
    feats = torch.randn(sum(pending), hidden, generator=gen).to(dtype)
    toks = torch.randint(0, VOCAB, (sum(pending),), generator=gen)
    lens = torch.tensor(pending)
    roots = toks[torch.cumsum(lens, 0) - 1]
    pages, done = torch.from_numpy(table).long(), torch.tensor(committed, dtype=torch.long)
    assert can_grow_natively(draft, embed, CPU)
    with torch.inference_mode():
        fast_cache = (k0.clone(), v0.clone())
        fast = grow_natively(draft, embed, fast_cache, feats, roots, pages, done, cfg, PAGE,
                             (toks, lens, torch.tensor(starts)))
        slow_cache = (k0.clone(), v0.clone())
        layout = Layout(toks.numpy(), lens.numpy().astype(np.int32),
                        np.array(starts, dtype=np.int32), table)
        fb = build_forward_batch(layout, PAGE, CPU)
        out = draft(embed(fb.input_ids), feats, fb, slow_cache)
        root_out = out.index_select(0, torch.cumsum(lens, 0) - 1)
        slow = draft_tree(draft, embed, slow_cache, root_out, roots, pages, done, cfg, PAGE)
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert torch.equal(fast_cache[0], slow_cache[0]) and torch.equal(fast_cache[1], slow_cache[1])


@pytest.fixture(scope="module")
def wide_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Drafts over a 96- and a 300-token vocabulary (top-k of 2-4 then takes both of the
    CPU kernel's branches: k * 64 above and below the vocabulary)."""
    root = tmp_path_factory.mktemp("wide")
    out = {}
    for vocab in (96, 300):
        target = make_checkpoint(root / f"t{vocab}", "llama", hidden=64, layers=4, vocab=vocab)
        out[vocab] = make_draft(root / f"d{vocab}", target)
    return out


@pytest.mark.parametrize("vocab", [96, 300])
@pytest.mark.parametrize("shape", [(4, 2, 8), (3, 3, 9), (3, 4, 12)])
def test_native_tree_breaks_ties_like_the_eager_loop(wide_drafts: dict[int, Path], vocab: int,
                                                     shape: tuple[int, int, int]) -> None:
    """lm_head rows repeating every 7 tokens: every log-probability is shared by ~vocab / 7
    tokens, so which of the tied tokens the tree holds, and in which order, is decided by
    the top-k's tie order alone (the native loop's own top-k against torch.topk)."""
    _native_or_skip()
    from tpserve.models.eagle3 import build_eagle3, load_eagle3_config

    hidden, cfg, dtype = 64, SpecConfig(*shape), torch.float32
    draft = build_eagle3(wide_drafts[vocab], load_eagle3_config(wide_drafts[vocab]),
                         TPContext.single(), dtype, CPU, 256)
    head = draft.lm_head.weight.data
    head.copy_(head[torch.arange(head.shape[0]) % 7])
    gen = torch.Generator().manual_seed(vocab + cfg.topk)
    embed = VocabParallelEmbedding(vocab, hidden, TPContext.single(), dtype, CPU)
    embed.weight.data.copy_(torch.randn(vocab, hidden, generator=gen))
    committed = [5, 9]
    start = torch.randn(len(committed), hidden, generator=gen)
    roots = torch.randint(0, vocab, (len(committed),), generator=gen)
    table = _pages(committed, cfg.num_steps * cfg.topk, np.random.default_rng(vocab))
    attn = draft.self_attn
    slots = (int(table.max()) + 1) * PAGE
    k0 = torch.randn(slots, attn.kv_heads, attn.head_dim, generator=gen)
    v0 = torch.randn(slots, attn.kv_heads, attn.head_dim, generator=gen)
    pages, done = torch.from_numpy(table).long(), torch.tensor(committed, dtype=torch.long)
    with torch.inference_mode():
        top = torch.log_softmax(draft.logits(start), -1).topk(cfg.topk, -1).values
        trees = [draft_tree(draft, embed, (k0.clone(), v0.clone()), start, roots, pages, done,
                            cfg, PAGE, native=native) for native in (True, False)]
    assert (top == top[:, :1]).all()  # the root's k best are one tied value
    fast, slow = trees
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
