"""Building the speculative decoder on a rank: draft model, draft KV cache, checks."""

from __future__ import annotations

import logging

import torch

from tpserve.engine.kv_cache import KVCache, KVCacheConfig
from tpserve.engine.runner import ModelRunner
from tpserve.layers.tp import TPContext
from tpserve.models.config import ModelConfigError
from tpserve.models.eagle3 import aux_layer_indices, build_eagle3, load_eagle3_config
from tpserve.spec.config import SpecConfig, check_draft_matches
from tpserve.spec.worker import SpecDecoder

log = logging.getLogger(__name__)


def build_spec(cfg: SpecConfig, draft_path: str, runner: ModelRunner, tp: TPContext,
               dtype: torch.dtype, max_position: int) -> SpecDecoder:
    """Load the EAGLE-3 draft beside ``runner``'s target; errors become SystemExit."""
    if cfg.num_steps + 1 >= 64:
        # Rotary tables reach 64 positions past the context (serve.setup_rank).
        raise SystemExit("error: --speculative-num-steps must be below 63")
    target = runner.model.cfg
    try:
        draft_cfg = load_eagle3_config(draft_path)
    except (ModelConfigError, OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read draft model: {exc}") from None
    check_draft_matches(draft_cfg, target)
    aux = aux_layer_indices(draft_cfg, target.num_layers)
    try:
        draft = build_eagle3(draft_path, draft_cfg, tp, dtype, runner.device, max_position)
    except ValueError as exc:  # shape mismatches, missing tensors
        raise SystemExit(f"error: cannot load draft model '{draft_path}': {exc}") from None
    kv = runner.kv.cfg
    base = draft_cfg.base
    # Same pages as the target: the draft reuses each request's page table.
    draft_kv = KVCache(KVCacheConfig.gqa(kv.num_pages, kv.page_size, 1,
                                         draft.self_attn.kv_heads, base.head_dim, dtype),
                       runner.device)
    log.info("EAGLE-3 draft: aux layer inputs %s, steps %d, topk %d, %d draft tokens",
             aux, cfg.num_steps, cfg.topk, cfg.num_draft_tokens)
    return SpecDecoder(runner, draft, draft_kv, cfg, aux)
