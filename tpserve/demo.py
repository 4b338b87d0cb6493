"""The built-in demo checkpoint: a small deterministic Llama created on first use.

Random weights (seeded) and a byte-level tokenizer, written as a normal Hugging Face
directory under the user's cache dir, so the server, ``transformers`` and the tests all load
it the same way. Shapes divide evenly for TP = 1, 2, 4 and 8.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

DEMO_NAME = "tpserve-demo-random-v1"
DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32,
    "vocab_size": 320, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 256,
    "eos_token_id": 257, "pad_token_id": 258, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
}
SPECIALS = ("<s>", "</s>", "<pad>")


def cache_dir() -> Path:
    root = os.environ.get("TPSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tpserve")
    return Path(root)


def byte_tokenizer_json() -> dict:
    """A byte-level BPE with no merges: every byte is a token, specials follow at 256+."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    added = [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
           "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    return out


def write_demo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 257, "bos_token_id": 256}))
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False}))
    save_file(random_weights(DEMO_CONFIG), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def ensure_demo_model() -> Path:
    """Create the demo checkpoint once (atomically: concurrent ranks never see half a dir)."""
    final = cache_dir() / DEMO_NAME
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=DEMO_NAME + ".", dir=final.parent))
    write_demo(tmp)
    try:
        os.rename(tmp, final)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final
