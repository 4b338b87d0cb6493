"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocab.

The vocab is padded up to a multiple of the TP size; padded rows are zero in the embedding
and produce logits that are trimmed off after the gather (or never looked at, where the
ranks exchange their shards' greedy picks instead: ``ParallelLMHead.greedy``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.layers import cpu_ops
from tpserve.layers.linear import _param, copy_into, linear
from tpserve.layers.tp import TPContext, native_exchange, run_exchanging

# A shard's pick travels as float32 (its token id among them): exact below 2**24 ids.
PICK_EXACT_IDS = 1 << 24


class VocabShard(nn.Module):
    """Common slice bookkeeping and loader for both embedding and head."""

    def __init__(self, vocab: int, hidden: int, tp: TPContext, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        self.per_rank = -(-vocab // tp.size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab)
        self.weight = _param((self.per_rank, hidden), dtype, device)
        self.weight.data.zero_()
        self.weight.weight_loader = self.load_weight

    def load_weight(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        rows = self.end - self.start
        if rows > 0:
            copy_into(param.data[:rows], source[self.start : self.end], "vocab shard")


# Largest whole table a CPU rank keeps beside its shard (see VocabParallelEmbedding).
REPLICATED_TABLE_BYTES = 256 << 20


class VocabParallelEmbedding(VocabShard):
    """Each rank looks up its vocab slice and the ranks sum (one allreduce a forward).

    On CPU at TP > 1 a rank also keeps the whole table, copied from the checkpoint as it
    loads, when it is at most ``REPLICATED_TABLE_BYTES``, and looks every token up locally:
    the same rows (the sum adds only zeros to the one owning rank's row, which is exact),
    without the collective and the ~6 masking ops around it. On the demo target at TP = 2
    those were ~5% of a 1 ms batch-1 decode step. GPU ranks and tables too large to repeat
    on every rank (a 129K x 7168 bf16 table is 1.8 GB) keep the vocab-parallel lookup."""

    def __init__(self, vocab: int, hidden: int, tp: TPContext, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(vocab, hidden, tp, dtype, device)
        self.table: torch.Tensor | None = None

    def load_weight(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        super().load_weight(param, source, shard_id)
        shape = (self.vocab, param.shape[1])
        if (self.tp.size > 1 and param.device.type == "cpu"
                and shape[0] * shape[1] * param.element_size() <= REPLICATED_TABLE_BYTES):
            table = torch.empty(shape, dtype=param.dtype)
            copy_into(table, source[: self.vocab], "embedding table")
            self.table = table

    @property
    def local_table(self) -> torch.Tensor | None:
        """The whole table a lookup reads on this rank alone (None where it collects)."""
        return self.weight if self.tp.size == 1 else self.table

    @property
    def collects(self) -> bool:
        """Whether a lookup runs a collective (the ranks sum their shards' rows)."""
        return self.local_table is None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.local_table
        if table is not None:
            return F.embedding(ids, table)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.comm.all_reduce(out)


class ParallelLMHead(VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits on every rank (float32 for sampling)."""
        local = linear(hidden, self.weight).float()
        full = self.tp.comm.all_gather(local)
        return full[..., : self.vocab]

    @property
    def picks_greedy(self) -> bool:
        """Whether ``greedy`` applies: a CPU head with the native ops, ids a float32 carries
        exactly."""
        return (self.weight.device.type == "cpu" and self.per_rank * self.tp.size <= PICK_EXACT_IDS
                and cpu_ops.load().impl == "c++")

    def greedy(self, hidden: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None
               ) -> tuple[list[int], list[float]]:
        """Each row's greedy token and its log-softmax value: at one rank the bits of
        ``fused.greedy_logprob`` over ``forward``'s logits; over several, each rank picks in
        its own vocab shard and the ranks exchange 12 bytes a row instead of the logits (the
        log-probability then equal up to rounding of the log-sum-exp). ``norm``: the final
        norm's (weight, eps), applied here (``hidden`` not normed yet). See
        ``vocab_pick.cpp``; on ``shm`` the exchange runs inside its native call."""
        tp, comm = self.tp, self.tp.comm
        weight, eps = norm if norm is not None else (None, 0.0)
        picks = torch.ops.tpserve.shard_pick(hidden, weight, eps, self.weight,
                                             max(0, self.end - self.start), self.start,
                                             tp.rank, tp.size)
        ex = native_exchange(comm, picks.dtype, picks.shape) if tp.size > 1 else None
        if ex is not None:
            tokens, logprobs = run_exchanging(comm, ex, 1, picks.nbytes, lambda args: (
                torch.ops.tpserve.combine_picks(picks, args)))
        else:
            if tp.size > 1:
                picks = comm.all_reduce(picks)  # zeros but one rank's fields: an all-gather
            tokens, logprobs = torch.ops.tpserve.combine_picks(picks, [])
        return tokens.tolist(), logprobs.tolist()
