"""Architecture name -> model class, and building a sharded model from a checkpoint dir."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tpserve.errors import ConfigError
from tpserve.layers.fp8 import native_blockwise_gemm
from tpserve.layers.huge_pages import rehome_parameters
from tpserve.layers.quant import Fp8BlockWeights, quantized_modules, resident_weight_bytes
from tpserve.layers.tp import TPContext
from tpserve.loader import load_weights, safetensors_files
from tpserve.models.config import ModelConfig, load_config
from tpserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from tpserve.models.llama import LlamaForCausalLM
from tpserve.models.moe_llama import MixtralForCausalLM, Qwen3MoeForCausalLM

log = logging.getLogger(__name__)

MODELS: Mapping[str, type[nn.Module]] = MappingProxyType({
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
})


def checkpoint_tensor_names(model_dir: Path) -> list[str]:
    names: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names.extend(handle.keys())
    return names


def _format_kwargs(cls: type[nn.Module], cfg: ModelConfig, model_dir: Path) -> dict[str, Any]:
    """The weight format for FP8 checkpoints (a model that takes ``weights``)."""
    if cfg.quant is None:
        return {}
    if "weights" not in inspect.signature(cls.__init__).parameters:
        raise ConfigError(f"FP8 block-quantised checkpoints are not supported for "
                          f"{cfg.architecture}")
    quantized = quantized_modules(checkpoint_tensor_names(model_dir))
    return {"weights": Fp8BlockWeights(cfg.quant.block, quantized)}


def _check_fp8_covered(model: Any, names: dict[str, Any], fmt: Any) -> None:
    """Every FP8 tensor the model loads must land in an FP8 layer (with its scales): copied
    into a dense parameter it would silently lose its block scales."""
    if not isinstance(fmt, Fp8BlockWeights):
        return
    ignored = getattr(model, "ignored_checkpoint_tensor", lambda name: False)
    uncovered = sorted(m for m in fmt.quantized if f"{m}.weight_scale_inv" not in names
                       and not ignored(f"{m}.weight"))
    if uncovered:
        raise ConfigError(f"FP8 weights for '{uncovered[0]}' are not supported (only decoder "
                          "projections and experts)")


def build_model(model_dir: str | Path, tp: TPContext, dtype: torch.dtype, device: torch.device,
                max_position: int, cfg: ModelConfig | None = None,
                attention: str = "auto") -> Any:
    """The model of ``model_dir`` with its weights loaded and ``attention``
    (``--attention-backend``) applied."""
    cfg = cfg or load_config(model_dir)
    start = time.perf_counter()
    cls = MODELS[cfg.architecture]
    kwargs = _format_kwargs(cls, cfg, Path(model_dir))
    model = cls(cfg, tp, dtype, device, max_position, **kwargs)
    if device.type == "cpu":
        rehome_parameters(model)  # before loading: the weights land in huge pages
    names = model.checkpoint_names()
    _check_fp8_covered(model, names, kwargs.get("weights"))
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_word_embeddings else {}
    load_weights(model, model_dir, names, aliases=aliases)
    if hasattr(model, "finish_loading"):
        model.finish_loading()
    model.set_attention_backend(attention)
    if cfg.quant is not None and device.type == "cuda":
        native_blockwise_gemm(device)  # probe now: never first inside a CUDA-graph capture
    log.info("loaded %s shard %d/%d in %.2fs: %.1f MB of weights resident", Path(model_dir).name,
             tp.rank, tp.size, time.perf_counter() - start, resident_weight_bytes(model) / 1e6)
    return model.eval()
