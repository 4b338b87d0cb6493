"""The attention-backend interface: what a model layer calls and what the engine prepares.

A backend is built once per model (its ``AttentionSpec``: heads per rank, head size, scale,
window, cache dtype). Per step the engine calls ``prepare(meta)`` once and hands the result to
every layer, which calls ``forward(q, k, v, cache, step)``: the backend writes the step's keys
and values into the layer's paged cache and attends over it. Preparing is where a backend
turns the metadata into whatever its kernels want (index tensors, a FlashInfer plan), so no
layer repeats that work.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from tpserve.layers.attention.metadata import AttentionMetadata

KVPair = tuple[torch.Tensor, torch.Tensor]  # ([slots, kv_heads, head_dim]) * 2, one layer


@dataclass(frozen=True)
class AttentionSpec:
    num_q_heads: int  # per rank
    num_kv_heads: int  # per rank; num_q_heads is a multiple of it
    head_dim: int
    scale: float
    dtype: torch.dtype  # KV cache dtype (q may differ; the output has q's dtype)
    sliding_window: int | None = None  # keys at or below query - window are hidden

    @property
    def window(self) -> int:
        return self.sliding_window or 0


@dataclass(frozen=True)
class PreparedStep:
    """What ``prepare`` returns; backends extend it with their per-step tensors."""

    meta: AttentionMetadata


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device

    @classmethod
    @abstractmethod
    def unavailable_reason(cls, spec: AttentionSpec, device: torch.device) -> str | None:
        """None when this backend can run ``spec`` on ``device``, else one line saying why."""

    def prepare(self, meta: AttentionMetadata) -> PreparedStep:
        """Once per step, before the first layer."""
        return PreparedStep(meta)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPair,
                step: PreparedStep) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hk, D] (this step's rows, in ``q_indptr`` order) ->
        [N, Hq * D] in q's dtype; k/v are written to ``step.meta.write_slots`` first."""
