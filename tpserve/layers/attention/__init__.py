"""Attention over the paged KV cache: pluggable backends selected by ``--attention-backend``.

- ``metadata``: the ragged per-step description (page table, q_indptr, kv_lens, write slots,
  optional speculative mask), built once per step;
- ``base``: the backend interface (``prepare`` once per step, ``forward`` per layer);
- ``registry``: ``create(name, spec, device)``, ``NAMES``, ``auto``;
- backends: ``cpu`` (native kernel, paged_attention.c), ``torch`` (gather + SDPA),
  ``flashinfer`` (CUDA);
"""

from tpserve.layers.attention.base import (
    Attend,
    AttentionBackend,
    AttentionSpec,
    KVPair,
    PreparedStep,
    bind,
)
from tpserve.layers.attention.metadata import AttentionMetadata, build_metadata
from tpserve.layers.attention.registry import NAMES, available, create, resolve_auto

__all__ = [
    "NAMES", "Attend", "AttentionBackend", "AttentionMetadata", "AttentionSpec", "KVPair",
    "PreparedStep", "available", "bind", "build_metadata", "create", "resolve_auto",
]
