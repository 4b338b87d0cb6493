"""The device-side draft tree, acceptance and KV compaction against the host-side versions
they replaced (kept here verbatim as references): same trees, tie-breaking included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.kv_cache import KVCache, KVCacheConfig
from tpserve.engine.plan import Layout, build_forward_batch
from tpserve.engine.sampler import target_probs
from tpserve.engine.sampling_params import SamplingParams
from tpserve.layers.fused import move_slots_reference
from tpserve.layers.tp import TPContext
from tpserve.models.eagle3 import build_eagle3, load_eagle3_config
from tpserve.spec.config import SpecConfig
from tpserve.spec.eagle import draft_tree
from tpserve.spec.tree import select_tree
from tpserve.spec.verify import accept_batch, accept_greedy, accept_sampled, greedy_path


def old_select_tree(roots: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor,
                    parents: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, ...]:
    batch = roots.shape[0]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : num_nodes - 1]
    chosen = order.sort(dim=1).values
    node_of = torch.full_like(scores, -1, dtype=torch.long)
    node_of.scatter_(1, chosen, torch.arange(1, num_nodes).expand(batch, -1).contiguous())
    cand_parent = parents.gather(1, chosen)
    node_parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
    assert not bool((node_parent < 0).any())
    all_tokens = torch.cat([roots[:, None], tokens.gather(1, chosen)], dim=1)
    all_parents = torch.cat([torch.full((batch, 1), -1), node_parent], dim=1)
    n = num_nodes
    mask = torch.eye(n, dtype=torch.bool).expand(batch, n, n).clone()
    depths = torch.zeros(batch, n, dtype=torch.long)
    rows = torch.arange(batch)
    for i in range(1, n):
        p = all_parents[:, i]
        mask[:, i] |= mask[rows, p]
        depths[:, i] = depths[rows, p] + 1
    return all_tokens, all_parents, depths, mask


def old_draft_tree(draft, embed, cache, start, roots, pages, committed, cfg, page_size):  # noqa: ANN001, ANN201
    batch, hidden = start.shape
    k, device = cfg.topk, start.device
    score, ids = torch.log_softmax(draft.logits(start), dim=-1).topk(k, dim=-1)
    tokens = draft.to_target(ids)
    scores, cands, parents = [score], [tokens], [torch.full_like(ids, -1)]
    beam_hidden = start[:, None, :].expand(batch, k, hidden)
    beam_score, beam_tokens = score, tokens
    beam_cand = torch.arange(k, device=device).expand(batch, k)
    ancestors = torch.zeros(batch, k, 0, dtype=torch.bool)
    offset = k
    for step in range(cfg.num_steps - 1):
        own = torch.cat([ancestors, torch.eye(k, dtype=torch.bool).expand(batch, k, k)], dim=2)
        positions = (committed + step)[:, None].expand(batch, k)
        base = (committed + step * k).numpy().astype(np.int32)
        layout = Layout(beam_tokens.reshape(-1).numpy(), np.full(batch, k, dtype=np.int32),
                        base, pages.numpy().astype(np.int32))
        fb: ForwardBatch = build_forward_batch(
            layout, page_size, device, positions=positions.reshape(-1).numpy(),
            mask_start=committed.numpy().astype(np.int32), custom_mask=own)
        out = draft(embed(beam_tokens.reshape(-1)), beam_hidden.reshape(-1, hidden), fb, cache)
        logp = torch.log_softmax(draft.logits(out), dim=-1).view(batch, k, -1)
        top_score, top_ids = logp.topk(k, dim=-1)
        child_score = (beam_score[:, :, None] + top_score).reshape(batch, k * k)
        child_tokens = draft.to_target(top_ids).reshape(batch, k * k)
        scores.append(child_score)
        cands.append(child_tokens)
        parents.append(beam_cand[:, :, None].expand(batch, k, k).reshape(batch, k * k))
        beam_score, pick = child_score.topk(k, dim=-1)
        parent_beam = pick // k
        beam_tokens = child_tokens.gather(1, pick)
        beam_cand = offset + pick
        beam_hidden = out.view(batch, k, hidden).gather(
            1, parent_beam[:, :, None].expand(batch, k, hidden))
        ancestors = own.gather(1, parent_beam[:, :, None].expand(batch, k, own.shape[2]))
        offset += k * k
    return old_select_tree(roots, torch.cat(scores, 1), torch.cat(cands, 1),
                           torch.cat(parents, 1), cfg.num_draft_tokens)


def _candidates(batch: int, k: int, steps: int, gen: torch.Generator
                ) -> tuple[torch.Tensor, ...]:
    """Beam-shaped candidates whose scores take few distinct values (many ties)."""
    scores, parents, offset = [-torch.randint(0, 3, (batch, k), generator=gen).double()], \
        [torch.full((batch, k), -1)], k
    beam = torch.arange(k).expand(batch, k)
    for _ in range(steps - 1):
        prev = scores[-1] if len(scores) == 1 else scores[-1].gather(1, beam - offset + k * k)
        step = -torch.randint(0, 2, (batch, k, k), generator=gen).double()
        scores.append((prev[:, :, None] + step).reshape(batch, k * k))
        parents.append(beam[:, :, None].expand(batch, k, k).reshape(batch, k * k))
        beam = offset + scores[-1].topk(k, dim=1).indices
        offset += k * k
    cand = torch.cat(scores, 1)
    return cand, torch.randint(0, 50, cand.shape, generator=gen), torch.cat(parents, 1)


@pytest.mark.parametrize("k,steps,nodes", [(1, 3, 4), (2, 4, 8), (3, 3, 9), (2, 2, 5)])
def test_select_tree_matches_host_version_with_ties(k: int, steps: int, nodes: int) -> None:
    gen = torch.Generator().manual_seed(k * 100 + steps)
    for _ in range(20):
        scores, tokens, parents = _candidates(6, k, steps, gen)
        roots = torch.randint(0, 50, (6,), generator=gen)
        new = select_tree(roots, scores, tokens, parents, nodes, steps)
        old = old_select_tree(roots, scores, tokens, parents, nodes)
        for a, b in zip((new.tokens, new.parents, new.depths, new.mask), old, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("k,steps,nodes", [(1, 3, 4), (2, 4, 8)])
def test_draft_tree_matches_host_version(tmp_path: Path, k: int, steps: int,
                                         nodes: int) -> None:
    target = make_checkpoint(tmp_path / "t", "llama", layers=4, vocab=40)
    draft_dir = make_draft(tmp_path / "d", target, draft_ids=list(range(0, 40, 3)))
    draft = build_eagle3(draft_dir, load_eagle3_config(draft_dir), TPContext.single(),
                         torch.float32, torch.device("cpu"), 64)
    embed = torch.nn.Embedding(40, 64)
    kv = KVCache(KVCacheConfig.gqa(16, 4, 1, 2, 16, torch.float32), torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    kv.pools[0].normal_(generator=gen)
    kv.pools[1].normal_(generator=gen)
    pages = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    committed = torch.tensor([3, 6, 1])
    start = torch.randn(3, 64, generator=gen)
    roots = torch.tensor([5, 7, 9])
    cfg = SpecConfig(steps, k, nodes)
    with torch.no_grad():
        old = old_draft_tree(draft, embed, kv.layers[0], start, roots, pages, committed, cfg, 4)
        new = draft_tree(draft, embed, kv.layers[0], start, roots, pages, committed, cfg, 4)
    for a, b in zip((new.tokens, new.parents, new.depths, new.mask), old, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
def test_move_slots_matches_per_layer_copies(native: bool, dtype: torch.dtype) -> None:
    """The C++ op (``KVCache.move_slots`` on CPU) and its ATen reference both equal copying
    each layer's rows with every source read first."""
    kv = KVCache(KVCacheConfig.gqa(4, 4, 3, 2, 8, dtype), torch.device("cpu"))
    for pool in kv.pools:
        pool.normal_()
    expected = [tuple(t.clone() for t in entries) for entries in kv.layers]
    src, dst = [6, 8, 13], [5, 6, 12]  # overlapping: 6 -> 5, 8 -> 6
    for entries in expected:
        for t in entries:
            t[dst] = t[src]
    if native:
        kv.move_slots(src, dst)
    else:
        move_slots_reference(list(kv.pools), src, dst)
    for got, want in zip(kv.layers, expected, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_greedy_path_is_accept_greedy_on_host_lists() -> None:
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    tokens, parents = [9, 1, 2, 3, 4], [-1, 0, 0, 1, 2]
    best = logits.argmax(-1).tolist()
    assert greedy_path(tokens, parents, best) == accept_greedy(tokens, parents, logits)


class _NoScalarReads(TorchDispatchMode):
    """Fails on any op that reads a tensor's value back to Python (``item``, ``bool``, ...):
    on a GPU each one waits for the device."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a host read of a device value inside drafting")
        return func(*args, **(kwargs or {}))


def test_draft_tree_reads_nothing_back(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "t", "llama", layers=4, vocab=40)
    draft_dir = make_draft(tmp_path / "d", target, draft_ids=list(range(0, 40, 3)))
    draft = build_eagle3(draft_dir, load_eagle3_config(draft_dir), TPContext.single(),
                         torch.float32, torch.device("cpu"), 64)
    kv = KVCache(KVCacheConfig.gqa(16, 4, 1, 2, 16, torch.float32), torch.device("cpu"))
    pages, committed = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([3, 6])
    start = torch.randn(2, 64)
    with torch.no_grad(), _NoScalarReads():
        tree = draft_tree(draft, torch.nn.Embedding(40, 64), kv.layers[0], start,
                          torch.tensor([5, 7]), pages, committed, SpecConfig(4, 2, 8), 4)
    assert tree.tokens.shape == (2, 8)


class _Req:
    def __init__(self, greedy: bool, seed: int) -> None:
        self.params = SamplingParams(temperature=0.0 if greedy else 0.8, max_new_tokens=4)
        self.generator = torch.Generator().manual_seed(seed)


def test_accept_batch_mixed_equals_per_request() -> None:
    """A batch mixing greedy and sampled requests decides each exactly as alone (each
    sampled request draws from its own generator, whatever the batch)."""
    gen = torch.Generator().manual_seed(7)
    batch, vocab = 6, 12
    tokens = torch.randint(0, vocab, (batch, 5), generator=gen)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * batch)
    logits = torch.randn(batch, 5, vocab, generator=gen) * 2
    reqs = [_Req(b % 2 == 0, b) for b in range(batch)]
    got = accept_batch(reqs, tokens, parents, logits)  # type: ignore[arg-type]
    for b, req in enumerate(reqs):
        toks, pars = tokens[b].tolist(), parents[b].tolist()
        if req.params.greedy:
            assert got[b] == accept_greedy(toks, pars, logits[b])
        else:
            probs = target_probs(logits[b], [req.params] * 5)
            alone = accept_sampled(toks, pars, probs, torch.Generator().manual_seed(b))
            assert got[b] == alone
