"""The tensors one model forward consumes: a ragged batch of query rows over the paged cache.

Request b feeds rows ``q_indptr[b]:q_indptr[b + 1]`` of ``input_ids`` / ``positions``
(decode tokens and prompt chunks mix without padding); how each row attends is described by
``attn`` (``tpserve.layers.attention.AttentionMetadata``: page table, key counts, write
slots, an optional speculative mask), built once per step and read by every layer.

``queries`` is Q when every request feeds exactly Q rows (decode, draft, verify steps): only
such batches are bucketed for CUDA graphs / torch.compile, padded with inert requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.layers.attention.metadata import AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    attn: AttentionMetadata
    queries: int  # rows per request when uniform, else 0

    @property
    def batch_size(self) -> int:
        return self.attn.batch_size

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])
