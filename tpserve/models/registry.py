"""Architecture name -> model class, and building a sharded model from a checkpoint dir."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch

from tpserve.layers.tp import TPContext
from tpserve.loader import load_weights
from tpserve.models.config import ModelConfig, load_config
from tpserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

MODELS: Mapping[str, type[LlamaForCausalLM]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
})


def build_model(model_dir: str | Path, tp: TPContext, dtype: torch.dtype, device: torch.device,
                max_position: int, cfg: ModelConfig | None = None) -> LlamaForCausalLM:
    cfg = cfg or load_config(model_dir)
    start = time.perf_counter()
    model = MODELS[cfg.architecture](cfg, tp, dtype, device, max_position)
    names = model.checkpoint_names()
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {}
    load_weights(model, model_dir, names, aliases=aliases)
    log.info("loaded %s shard %d/%d in %.2fs", Path(model_dir).name, tp.rank, tp.size,
             time.perf_counter() - start)
    return model.eval()
