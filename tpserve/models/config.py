"""Model hyper-parameters read from a Hugging Face ``config.json``.

One frozen dataclass covers the Llama family (Llama 2/3/3.x, Mistral, Qwen2, Qwen3); the
differences between them are flags (qkv bias, q/k norm, sliding window, rope scaling).
DeepSeek-V3 / Kimi-K2, Qwen3-MoE and Mixtral add optional sub-configs (latent attention,
experts, FP8 blocks: ``config_families``).
Both the transformers 4.x layout (``rope_theta``/``rope_scaling``) and the 5.x layout
(``rope_parameters``) are understood.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpserve.errors import ConfigError
from tpserve.models.config_families import (
    MOE_PARSERS,
    FamilyConfigError,
    MLAConfig,
    MoEConfig,
    QuantConfig,
    parse_mla,
    parse_quant,
)

# The registries of what tpserve reads: add an architecture or a quantization method here and
# the start-up checks (tpserve.preflight) and their messages follow.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM",  # also Kimi-K2 (model_type kimi_k2)
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
# ``quantization_config.quant_method`` values whose weights the loader reads (unquantized
# checkpoints carry no quantization_config at all).
SUPPORTED_QUANT_METHODS: tuple[str, ...] = ("fp8",)  # block-scaled e4m3 (config_families)

# model_type -> architecture, for configs without an "architectures" list.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
               "kimi_k2": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "mixtral": "MixtralForCausalLM"}


class ModelConfigError(ConfigError):
    """The checkpoint's config is missing, malformed or unsupported."""

    def __init__(self, message: str, flag: str | None = "--model") -> None:
        super().__init__(message, flag)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn only (defaults as in the YaRN paper and transformers)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None  # DeepSeek: also scales the softmax by mscale**2
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V3, Kimi-K2)
    moe: MoEConfig | None = None  # routed experts in some layers
    quant: QuantConfig | None = None  # FP8 block-scaled weights
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _rope_from(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise ModelConfigError(f"unsupported rope type '{rope_type}'")
    if rope_type == "yarn":
        return _yarn_from(params, float(theta), cfg)
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _yarn_from(params: dict[str, Any], theta: float, cfg: dict[str, Any]) -> RopeConfig:
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original

    def opt(key: str) -> float | None:
        return float(params[key]) if params.get(key) is not None else None

    return RopeConfig(theta=theta, rope_type="yarn", factor=float(factor),
                      original_max_position=original,
                      beta_fast=float(params.get("beta_fast") or 32.0),
                      beta_slow=float(params.get("beta_slow") or 1.0), mscale=opt("mscale"),
                      mscale_all_dim=opt("mscale_all_dim"),
                      attention_factor=opt("attention_factor"),
                      truncate=bool(params.get("truncate", True)))


def _family_parts(cfg: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """MLA / MoE / FP8 fields of ModelConfig (empty for a dense unquantised model)."""
    parts: dict[str, Any] = {}
    try:
        if arch == "DeepseekV3ForCausalLM":
            mla = parse_mla(cfg)
            heads = int(cfg["num_attention_heads"])
            parts.update(mla=mla, head_dim=mla.qk_head_dim, num_kv_heads=heads)
        if arch in MOE_PARSERS:
            parts["moe"] = MOE_PARSERS[arch](cfg, num_layers)
        parts["quant"] = parse_quant(cfg)
    except FamilyConfigError as exc:
        raise ModelConfigError(str(exc)) from exc
    return parts


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    window = cfg.get("sliding_window")
    # Qwen2/3 configs carry a window but only use it when use_sliding_window is set.
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def parse_config(cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else MODEL_TYPES.get(cfg.get("model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"architecture '{arch or cfg.get('model_type')}' is not served by tpserve "
            f"(it serves: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        base = ModelConfig(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope=_rope_from(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_sliding_window(cfg, arch),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            raw=cfg,
        )
        return dataclasses.replace(base, **_family_parts(cfg, arch, base.num_layers))
    except KeyError as exc:
        raise ModelConfigError(f"config.json lacks required key {exc}") from exc


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model directory '{model_dir}' does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelConfigError(f"missing model config {cfg_file}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{cfg_file} is not valid JSON: {exc}") from exc
    return parse_config(cfg)
