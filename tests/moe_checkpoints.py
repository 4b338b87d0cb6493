"""Tiny random MLA / MoE checkpoints (DeepSeek-V3, Kimi-K2, Qwen3-MoE, Mixtral) and FP8 copies.

Every checkpoint is written by transformers itself (``save_pretrained``), so names and layout
are what transformers 5 writes; helpers then add what published checkpoints carry beyond
that (multi-token-prediction layers, FP8 block weights). ``hf_dir(path)`` is the directory
transformers should load as the reference (for Kimi-K2, whose ``model_type`` transformers
does not know, a copy with the DeepSeek-V3 type).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tpserve.layers.fp8 import dequantize, quantize

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48,
                qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.8})
# Kimi-K2's shape of routing: one expert group; here also without q_lora (plain q_proj).
KIMI = {**DEEPSEEK, "n_group": 1, "topk_group": 1, "q_lora_rank": None,
        "routed_scaling_factor": 2.827, "rope_parameters": {**YARN, "mscale": 1.0,
                                                            "mscale_all_dim": 1.0}}
QWEN3_MOE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])
MIXTRAL = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "deepseek": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
    "kimi": ("DeepseekV3Config", "DeepseekV3ForCausalLM", KIMI),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", MIXTRAL),
}


# FP8 copy: a non-square block with partial edge blocks; an expert-heavy shape like the real
# model (experts are ~95% of DeepSeek-V3's weights), so a tiny vocab's unquantised embeddings
# do not dominate the byte count. Block-aligned at TP 2 (q_b_proj: 48 rows per rank).
FP8_BLOCK = (16, 8)
FP8_SHAPE = dict(n_routed_experts=16, moe_intermediate_size=64, intermediate_size=192)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial norms, a non-zero correction bias, and routers decisive enough that fp32
    rounding never flips an expert choice."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def make_moe_checkpoint(path: Path, family: str, *, seed: int = 0, vocab: int = 96,
                        shards: int = 1, **overrides: Any) -> Path:
    import transformers

    cfg_cls, model_cls, shape = FAMILIES[family]
    config = getattr(transformers, cfg_cls)(
        **{**shape, **overrides}, vocab_size=vocab, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    _randomise(model, seed)
    size = "1GB" if shards == 1 else f"{max(1, model.num_parameters() * 4 // shards // 1000)}KB"
    model.save_pretrained(path, max_shard_size=size)
    if family == "kimi":
        shutil.copytree(path, path.with_name(path.name + "_hf"))
        _edit_config(path, model_type="kimi_k2")
    return path


def hf_dir(path: Path) -> Path:
    """Where transformers loads the reference from (Kimi: a DeepSeek-V3-typed copy; FP8: the
    dequantised weights)."""
    for twin in (path.with_name(path.name + "_hf"), path.with_name(path.name + "_ref")):
        if twin.is_dir():
            return twin
    return path


def _edit_config(path: Path, **changes: Any) -> None:
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg, indent=1))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def add_mtp_layer(path: Path) -> None:
    """Append a multi-token-prediction layer (index num_hidden_layers) in its own shard, as
    DeepSeek-V3 publishes it, and list it in the index."""
    cfg = json.loads((path / "config.json").read_text())
    last, mtp = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    tensors = _tensors(path)
    extra = {k.replace(f"layers.{last}.", f"layers.{mtp}."): v.clone()
             for k, v in tensors.items() if k.startswith(f"model.layers.{last}.")}
    hidden = cfg["hidden_size"]
    extra.update({f"model.layers.{mtp}.enorm.weight": torch.ones(hidden),
                  f"model.layers.{mtp}.hnorm.weight": torch.ones(hidden),
                  f"model.layers.{mtp}.eh_proj.weight": torch.zeros(hidden, 2 * hidden),
                  f"model.layers.{mtp}.shared_head.head.weight": tensors["lm_head.weight"]})
    save_file(extra, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
    else:
        index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(extra, "model-mtp.safetensors"))
    index_file.write_text(json.dumps(index, indent=1))
    _edit_config(path, num_nextn_predict_layers=1)


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """What DeepSeek's FP8 release stores in FP8: every decoder projection but the router."""
    return (tensor.dim() == 2 and name.startswith("model.layers.") and "norm" not in name
            and not name.endswith("mlp.gate.weight") and name.endswith(".weight"))


def make_fp8_copy(src: Path, dst: Path, ref: Path, block: tuple[int, int]) -> None:
    """``dst``: an FP8 block-quantised copy of ``src``; ``ref``: the same weights dequantised
    (what transformers runs as the reference)."""
    tensors = _tensors(src)
    fp8: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if quantizable(name, t):
            q, scale = quantize(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dense[name] = dequantize(q, scale, block)
        else:
            fp8[name] = dense[name] = t
    for out, weights in ((dst, fp8), (ref, dense)):
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(hf_dir(src) / "config.json" if out == ref else src / "config.json", out)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _edit_config(dst, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                           "activation_scheme": "dynamic",
                                           "weight_block_size": list(block)})


def make_fp8_checkpoints(root: Path) -> dict[str, Path]:
    """{"src": bf16-shaped original, "fp8": its FP8 copy, "ref": the dequantised weights}."""
    src = make_moe_checkpoint(root / "fp8_src", "deepseek", vocab=64, **FP8_SHAPE)
    make_fp8_copy(src, root / "fp8", root / "fp8_ref", FP8_BLOCK)
    return {"src": src, "fp8": root / "fp8", "ref": root / "fp8_ref"}


# A DeepSeek-V3 whose (8, 8) FP8 blocks split on block boundaries at TP 2, 4 and 8, as
# DeepSeek-V3's 128 x 128 blocks do at TP 8 (8 heads, 16 experts).
TP8_FP8_BLOCK = (8, 8)
TP8_FP8_SHAPE = dict(num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=64,
                     intermediate_size=192)


def make_tp8_fp8_checkpoint(root: Path) -> Path:
    """The FP8 copy (under ``root``) of the DeepSeek-V3 that TP 8 shards on block boundaries."""
    src = make_moe_checkpoint(root / "src", "deepseek", vocab=64, **TP8_FP8_SHAPE)
    make_fp8_copy(src, root / "fp8", root / "ref", TP8_FP8_BLOCK)
    return root / "fp8"
