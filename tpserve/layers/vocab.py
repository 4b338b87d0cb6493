"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocab.

The vocab is padded up to a multiple of the TP size; padded rows are zero in the embedding
and produce logits that are trimmed off after the gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.layers.linear import _param, copy_into, linear
from tpserve.layers.tp import TPContext


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


class VocabParallelEmbedding(VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
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
