"""Writing a trained draft in the published EAGLE-3 checkpoint format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tpserve.errors import ConfigError
from tpserve.train.draft_model import Eagle3Trainable
from tpserve.train.eagle_data import DraftVocab


def capturable_aux_ids(ids: tuple[int, ...], num_layers: int) -> bool:
    """Three distinct layer-output ids in 0..L - 2 (see ``default_aux_ids``)."""
    return len(ids) == 3 and len(set(ids)) == 3 and all(0 <= i <= num_layers - 2 for i in ids)


def default_aux_ids(num_layers: int) -> tuple[int, ...]:
    """Layer-output ids (SpecForge's choice: 1, L/2 - 1, L - 4; spread out on tiny targets).

    Ids stay <= L - 2: Hugging Face's last hidden state is already final-normed, while the
    engine captures the raw residual stream, so the last layer's output is never used.
    """
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if capturable_aux_ids(ids, num_layers):
        return tuple(sorted(ids))
    if num_layers < 4:
        raise ConfigError(f"EAGLE-3 needs a target with at least 4 layers (got {num_layers})",
                          flag="--target")
    return (0, (num_layers - 2) // 2, num_layers - 2)


def draft_config(draft: Eagle3Trainable, aux_ids: tuple[int, ...], target_cfg: dict,
                 dtype: str) -> dict:
    s = draft.shape
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": s.hidden_size, "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads, "head_dim": s.head_dim,
        "intermediate_size": s.intermediate_size, "num_hidden_layers": 1,
        "vocab_size": target_cfg["vocab_size"], "draft_vocab_size": s.draft_vocab_size,
        "target_hidden_size": s.target_hidden_size, "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta, "hidden_act": "silu",
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 2048),
        "tie_word_embeddings": False, "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)},
    }


def export_draft(draft: Eagle3Trainable, vocab: DraftVocab, aux_ids: tuple[int, ...],
                 target_cfg: dict, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", dtype).contiguous()
               for name, t in draft.state_dict().items()}
    tensors["d2t"] = vocab.d2t()
    tensors["t2d"] = vocab.t2d(target_cfg["vocab_size"])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = draft_config(draft, aux_ids, target_cfg, str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def load_exported(draft: Eagle3Trainable, path: Path) -> DraftVocab:
    """Warm start: ``draft`` takes the weights of a draft ``export_draft`` wrote (same shape),
    and the vocabulary it was trained with is returned (its ``d2t``)."""
    tensors = load_file(str(path / "model.safetensors"))
    d2t = tensors.pop("d2t")
    tensors.pop("t2d", None)
    mine = draft.state_dict()
    if set(tensors) != set(mine) or any(tensors[k].shape != mine[k].shape for k in mine):
        raise ConfigError(f"the draft in '{path}' does not have this draft's shape",
                          flag="--init-from")
    draft.load_state_dict({k: v.float() for k, v in tensors.items()})
    return DraftVocab(d2t + torch.arange(d2t.numel()))
