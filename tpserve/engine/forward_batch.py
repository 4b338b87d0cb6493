"""The tensors one model forward consumes, padded to a rectangular [batch, query] shape.

Every request contributes Q query tokens (padded) and reads T key slots (padded) from the
paged KV cache. Shapes depend only on (B, Q, T), never on the data, which is what CUDA-graph
or torch.compile buckets need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [B, Q] int64
    positions: torch.Tensor  # [B, Q] int64
    write_slots: torch.Tensor  # [B, Q] int64; padded queries write to the dummy slot 0
    read_slots: torch.Tensor  # [B, T] int64; padded keys read the dummy slot 0
    mask: torch.Tensor  # [B, 1, Q, T] bool, True = query may attend to key

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> ForwardBatch:
        return ForwardBatch(*(t.to(device, non_blocking=True) for t in (
            self.input_ids, self.positions, self.write_slots, self.read_slots, self.mask)))
