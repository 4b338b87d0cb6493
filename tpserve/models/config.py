"""Model hyper-parameters read from a Hugging Face ``config.json``.

One frozen dataclass covers the Llama family (Llama 2/3/3.x, Mistral, Qwen2, Qwen3); the
differences between them are flags (qkv bias, q/k norm, sliding window, rope scaling).
Both the transformers 4.x layout (``rope_theta``/``rope_scaling``) and the 5.x layout
(``rope_parameters``) are understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpserve.errors import ConfigError

# The registries of what tpserve reads: add an architecture or a quantization method here and
# the start-up checks (tpserve.preflight) and their messages follow.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# ``quantization_config.quant_method`` values whose weights the loader reads (unquantized
# checkpoints carry no quantization_config at all).
SUPPORTED_QUANT_METHODS: tuple[str, ...] = ()


class ModelConfigError(ConfigError):
    """The checkpoint's config is missing, malformed or unsupported."""

    def __init__(self, message: str, flag: str | None = "--model") -> None:
        super().__init__(message, flag)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


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
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _rope_from(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ModelConfigError(f"unsupported rope type '{rope_type}'")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


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
    arch = archs[0] if archs else {"llama": "LlamaForCausalLM"}.get(cfg.get("model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"architecture '{arch or cfg.get('model_type')}' is not served by tpserve "
            f"(it serves: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelConfig(
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
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(cfg, arch),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            raw=cfg,
        )
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
