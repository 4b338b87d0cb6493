"""Attention over the paged KV cache: pluggable backends selected by ``--attention-backend``.

- ``metadata``: the ragged per-step description (page table, q_indptr, kv_lens, write slots,
  optional speculative mask), built once per step;
- ``base``: the backend interface (``prepare`` once per step, ``forward`` per layer);
- ``registry``: ``create(name, spec, device)``, ``NAMES``, ``auto``;
- backends: ``cpu`` (native kernel, paged_attention.c), ``torch`` (gather + SDPA),
  ``flashinfer`` (CUDA);
- ``gather.paged_attention``: the padded ForwardBatch path the models call until the engine
  sends the ragged metadata.
"""

from tpserve.layers.attention.base import AttentionBackend, AttentionSpec, KVPair, PreparedStep
from tpserve.layers.attention.gather import paged_attention
from tpserve.layers.attention.metadata import AttentionMetadata, build_metadata
from tpserve.layers.attention.registry import NAMES, available, create, resolve_auto

__all__ = [
    "NAMES", "AttentionBackend", "AttentionMetadata", "AttentionSpec", "KVPair", "PreparedStep",
    "available", "build_metadata", "create", "paged_attention", "resolve_auto",
]
