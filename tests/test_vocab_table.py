"""The replicated CPU embedding table gives the rows the vocab-parallel lookup sums to."""

from __future__ import annotations

import pytest
import torch

from tpserve.layers import vocab as vocab_mod
from tpserve.layers.tp import TPContext
from tpserve.layers.vocab import VocabParallelEmbedding

VOCAB, HIDDEN = 37, 16  # not a multiple of the TP size: the last shard is padded


class Passthrough:
    """A one-process stand-in for the allreduce: the partial sum as it is."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _ranks(dtype: torch.dtype) -> tuple[list[VocabParallelEmbedding], torch.Tensor]:
    source = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    ranks = []
    for rank in range(2):
        emb = VocabParallelEmbedding(VOCAB, HIDDEN, TPContext(rank, 2, Passthrough()), dtype,
                                     torch.device("cpu"))
        emb.weight.weight_loader(emb.weight, source)
        ranks.append(emb)
    return ranks, source


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_local_table_equals_the_summed_shards(dtype: torch.dtype) -> None:
    ranks, source = _ranks(dtype)
    ids = torch.tensor([0, 18, 19, 36, 5, 36, 0])  # both shards, their edges, repeats
    assert all(r.table is not None for r in ranks)
    local = [r(ids) for r in ranks]
    for r in ranks:
        r.table = None
    summed = ranks[0](ids) + ranks[1](ids)  # what the allreduce of the masked lookups gives
    for out in local:
        assert out.dtype == dtype and torch.equal(out, summed)
        assert torch.equal(out, source[ids])


def test_tables_too_large_to_repeat_stay_sharded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vocab_mod, "REPLICATED_TABLE_BYTES", VOCAB * HIDDEN * 2 - 1)
    ranks, _ = _ranks(torch.bfloat16)
    assert all(r.table is None for r in ranks)
    single = VocabParallelEmbedding(VOCAB, HIDDEN, TPContext.single(), torch.bfloat16,
                                    torch.device("cpu"))
    single.weight.weight_loader(single.weight, torch.zeros(VOCAB, HIDDEN))
    assert single.table is None  # one rank: its shard is the table


def test_the_draft_reads_the_same_table_without_a_gather() -> None:
    """A replicated draft at TP = 2 reads the whole table: the one the CPU rank already keeps
    (no process group here, so a gather would fail), shared, not copied."""
    from tpserve.spec.setup import draft_embedding

    ranks, source = _ranks(torch.bfloat16)
    draft = draft_embedding(ranks[1], TPContext.single())
    assert draft.weight.data_ptr() == ranks[1].table.data_ptr()
    ids = torch.tensor([0, 18, 19, 36])
    assert torch.equal(draft(ids), source[ids])


def _gathered_draft_table(rank: int, world: int) -> dict[str, object]:
    """One rank of a gloo world whose embedding stays sharded (as on a GPU rank)."""
    vocab_mod.REPLICATED_TABLE_BYTES = 0  # this process only: no whole table kept
    from tpserve.spec.setup import draft_embedding

    source = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, TPContext(rank, world, Passthrough()),
                                 torch.bfloat16, torch.device("cpu"))
    emb.weight.weight_loader(emb.weight, source)
    assert emb.table is None
    draft = draft_embedding(emb, TPContext.single())
    ids = torch.tensor([0, 18, 19, 36, 7])
    return {"shape": tuple(draft.weight.shape), "rows": draft(ids).float(),
            "expected": source.bfloat16()[ids].float(), "shard_ptr": emb.weight.data_ptr(),
            "ptr": draft.weight.data_ptr()}


def test_a_sharded_table_is_gathered_whole_for_a_replicated_draft() -> None:
    """TP = 2 with the table kept only as shards (GPU ranks): the draft's copy is every
    rank's slice in rank order, the last shard's padding cut off, its own memory."""
    from tests.harness import spawn

    for result in spawn(2, _gathered_draft_table):
        assert result["shape"] == (VOCAB, HIDDEN)
        assert torch.equal(result["rows"], result["expected"])
        assert result["ptr"] != result["shard_ptr"]
