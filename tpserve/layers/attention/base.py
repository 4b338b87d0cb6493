"""The attention-backend interface: what a model layer calls and what the engine prepares.

A backend is built once per model (its ``AttentionSpec``: heads per rank, head size, scale,
window, cache dtype). Per step the engine calls ``prepare(meta)`` once and hands the result to
every layer, which calls ``forward(q, k, v, cache, step)``: the backend writes the step's keys
and values into the layer's paged cache and attends over it. Preparing is where a backend
turns the metadata into whatever its kernels want (index tensors, a FlashInfer plan), so no
layer repeats that work.

CUDA graphs record ``prepare`` with the forward, so a backend whose preparation is host work
(a FlashInfer plan) gets two hooks: ``graph_capture(meta)`` once, outside the graph, for the
graph's static metadata (``prepare`` of that very object must then do no host work), and
``graph_replan(static, meta)`` before each replay with the step's real, bucket-padded metadata.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

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


@runtime_checkable
class GraphPlanned(Protocol):
    """What a CUDA-graph executor calls on a step's attention around capture and replay (every
    ``AttentionBackend``, and the MLA backends that plan on the host)."""

    def graph_capture(self, static: AttentionMetadata) -> None: ...

    def graph_replan(self, static: AttentionMetadata, meta: AttentionMetadata) -> None: ...

    def graph_release(self, static: AttentionMetadata) -> None: ...

    def graph_reads_in_place(self, static: AttentionMetadata) -> bool: ...


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

    def graph_capture(self, static: AttentionMetadata) -> None:
        """``static`` is a CUDA graph's input metadata, about to be captured (warm-up first).
        Default: nothing, ``prepare`` is device work the graph records and replays."""
        return None

    def graph_replan(self, static: AttentionMetadata, meta: AttentionMetadata) -> None:
        """Before a replay of the graph captured over ``static``: ``meta`` (same batch size) is
        the step it now runs, already copied into ``static``'s tensors. Default: nothing."""
        return None

    def graph_reads_in_place(self, static: AttentionMetadata) -> bool:
        """Whether a graph captured over ``static`` attends over the pages each replay's plan
        names, whatever the static page table's width (the executor then captures one key
        span). Default: False, the graph gathers as many keys as the static table holds."""
        return False

    def graph_release(self, static: AttentionMetadata) -> None:
        """The graph captured over ``static`` was dropped (recapture). Default: nothing."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPair,
                step: PreparedStep) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hk, D] (this step's rows, in ``q_indptr`` order) ->
        [N, Hq * D] in q's dtype; k/v are written to ``step.meta.write_slots`` first."""


# What a model layer calls: write this step's k/v into ``cache`` and attend (q, k, v, cache).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVPair], torch.Tensor]


def bind(backend: AttentionBackend, meta: AttentionMetadata) -> Attend:
    """Prepare ``meta`` once for the step and give every layer the same prepared call."""
    return functools.partial(backend.forward, step=backend.prepare(meta))
