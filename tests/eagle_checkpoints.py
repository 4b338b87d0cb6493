"""EAGLE-3 draft checkpoints in the published format, written by the tests themselves."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def target_tensors(target_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def zero_final_norm(target_dir: Path) -> None:
    """All target logits become 0, so greedy decoding always picks token 0."""
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        tensors = load_file(str(f))
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
            save_file(tensors, str(f), metadata={"format": "pt"})


def make_draft(path: Path, target_dir: Path, *, aux_ids: tuple[int, ...] | None = (0, 1, 3),
               heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
               draft_ids: list[int] | None = None, mimic: bool = False, seed: int = 1,
               arch: str = "LlamaForCausalLMEagle3", scale: float = 0.05,
               target_hidden: int | None = None) -> Path:
    """Random draft; ``draft_ids`` = target ids of the draft vocab (None: full vocab).

    ``mimic``: fc passes the last aux state through and norm / lm_head are the target's, so
    the draft proposes "the target's next token again" (non-trivial acceptance).
    """
    tgt_cfg = json.loads((Path(target_dir) / "config.json").read_text())
    h, vocab = tgt_cfg["hidden_size"], tgt_cfg["vocab_size"]
    th = target_hidden or h
    dv = len(draft_ids) if draft_ids is not None else vocab
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, s: float = scale) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    d = h // heads
    w = {
        "fc.weight": rnd(h, 3 * th, s=0.2),
        "midlayer.self_attn.q_proj.weight": rnd(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * d),
        "midlayer.mlp.gate_proj.weight": rnd(intermediate, h),
        "midlayer.mlp.up_proj.weight": rnd(intermediate, h),
        "midlayer.mlp.down_proj.weight": rnd(h, intermediate),
        "midlayer.hidden_norm.weight": 1 + rnd(h, s=0.2),
        "midlayer.input_layernorm.weight": 1 + rnd(h, s=0.2),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(h, s=0.2),
        "norm.weight": 1 + rnd(h, s=0.2),
        "lm_head.weight": rnd(dv, h, s=0.5),
    }
    if mimic:
        tgt = target_tensors(target_dir)
        w["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)
        w["norm.weight"] = tgt["model.norm.weight"].clone()
        head = tgt.get("lm_head.weight", tgt["model.embed_tokens.weight"])
        w["lm_head.weight"] = head[draft_ids].clone() if draft_ids else head.clone()
    if draft_ids is not None:
        ids = torch.tensor(draft_ids, dtype=torch.long)
        w["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        w["t2d"] = t2d
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    cfg = {"architectures": [arch], "model_type": "llama", "hidden_size": h,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "intermediate_size": intermediate, "num_hidden_layers": 1, "vocab_size": vocab,
           "draft_vocab_size": dv, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
           "rope_theta": 10000.0, "torch_dtype": "float32"}
    if target_hidden is not None:
        cfg["target_hidden_size"] = target_hidden
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    (path / "config.json").write_text(json.dumps(cfg))
    return path
