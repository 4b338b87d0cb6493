"""Optional parts of a model config: multi-head latent attention, mixture of experts, FP8.

``ModelConfig`` carries these as optional sub-configs (None for a dense GQA model without
quantisation). Each is parsed from the raw ``config.json`` here, so ``config.py`` stays the
dense family's parser plus one call per part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class FamilyConfigError(ValueError):
    """A family-specific part of config.json is malformed or unsupported."""


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek-V2/V3 multi-head latent attention shapes."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the rope part pairs (x0, x1), (x2, x3), ... (GPT-J layout)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the compressed kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (and optional always-on shared experts) replacing some layers' MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    moe_layers: tuple[int, ...]  # indices of the layers whose MLP is a MoE
    scoring: str = "softmax"  # "softmax" (Qwen3-MoE, Mixtral) | "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # experts are split into groups; only topk_group groups are eligible
    topk_group: int = 1
    correction_bias: bool = False  # noaux_tc: e_score_correction_bias, selection only
    shared_intermediate_size: int = 0  # n_shared_experts * moe_intermediate_size


@dataclass(frozen=True)
class QuantConfig:
    """Block-scaled FP8 weights (``quantization_config`` of DeepSeek-V3 / Kimi-K2 FP8)."""

    block: tuple[int, int]  # (output rows, input columns) per scale
    ignored: tuple[str, ...] = ()  # module-name substrings left unquantised


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    if default is None:
        raise FamilyConfigError(f"config.json lacks required key '{keys[0]}'")
    return default


def parse_mla(cfg: dict[str, Any]) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=_int(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
        v_head_dim=_int(cfg, "v_head_dim"),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def deepseek_moe_layers(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """DeepSeek's rule: the first ``first_k_dense_replace`` layers are dense, then every
    ``moe_layer_freq``-th layer is a MoE (all published checkpoints use frequency 1)."""
    first = _int(cfg, "first_k_dense_replace", default=0)
    freq = _int(cfg, "moe_layer_freq", default=1)
    return tuple(i for i in range(num_layers) if i >= first and i % freq == 0)


def parse_deepseek_moe(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    method = cfg.get("topk_method") or "noaux_tc"
    scoring = cfg.get("scoring_func") or "sigmoid"
    if method != "noaux_tc" or scoring != "sigmoid":
        raise FamilyConfigError(f"DeepseekV3ForCausalLM routing topk_method='{method}', "
                                f"scoring_func='{scoring}' is not supported (noaux_tc, sigmoid)")
    experts = _int(cfg, "n_routed_experts", "num_local_experts")
    n_group = _int(cfg, "n_group", default=1)
    if experts % n_group:
        raise FamilyConfigError(f"n_routed_experts ({experts}) is not divisible by n_group "
                                f"({n_group})")
    inter = _int(cfg, "moe_intermediate_size")
    return MoEConfig(
        num_experts=experts, top_k=_int(cfg, "num_experts_per_tok"), intermediate_size=inter,
        moe_layers=deepseek_moe_layers(cfg, num_layers), scoring="sigmoid",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        n_group=n_group, topk_group=_int(cfg, "topk_group", default=1), correction_bias=True,
        shared_intermediate_size=inter * _int(cfg, "n_shared_experts", default=0),
    )


def parse_qwen3_moe(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    step = _int(cfg, "decoder_sparse_step", default=1)
    dense = set(cfg.get("mlp_only_layers") or [])
    experts = _int(cfg, "num_experts", "num_local_experts")
    layers = tuple(i for i in range(num_layers)
                   if i not in dense and experts > 0 and (i + 1) % step == 0)
    return MoEConfig(num_experts=experts, top_k=_int(cfg, "num_experts_per_tok"),
                     intermediate_size=_int(cfg, "moe_intermediate_size"), moe_layers=layers,
                     norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def parse_mixtral_moe(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    return MoEConfig(num_experts=_int(cfg, "num_local_experts"),
                     top_k=_int(cfg, "num_experts_per_tok"),
                     intermediate_size=_int(cfg, "intermediate_size"),
                     moe_layers=tuple(range(num_layers)), norm_topk_prob=True)


MOE_PARSERS = {
    "DeepseekV3ForCausalLM": parse_deepseek_moe,
    "Qwen3MoeForCausalLM": parse_qwen3_moe,
    "MixtralForCausalLM": parse_mixtral_moe,
}


def parse_quant(cfg: dict[str, Any]) -> QuantConfig | None:
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise FamilyConfigError(f"quantization '{method}' is not supported (fp8 block only)")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise FamilyConfigError(f"FP8 format '{fmt}' is not supported (e4m3)")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise FamilyConfigError("FP8 checkpoints without weight_block_size (per-tensor scales) "
                                "are not supported")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise FamilyConfigError("FP8 activation_scheme must be 'dynamic'")
    ignored = tuple(q.get("modules_to_not_convert") or ()) + tuple(q.get("ignored_layers") or ())
    return QuantConfig(block=(int(block[0]), int(block[1])), ignored=ignored)
