"""Tiny random Hugging Face checkpoints, built by the tests themselves (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

ARCH_CONFIGS = {
    "llama": dict(cls="LlamaConfig", model="LlamaForCausalLM", extra=dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_tied": dict(cls="LlamaConfig", model="LlamaForCausalLM",
                       extra=dict(tie_word_embeddings=True)),
    "mistral": dict(cls="MistralConfig", model="MistralForCausalLM", extra=dict(sliding_window=None)),
    "qwen2": dict(cls="Qwen2Config", model="Qwen2ForCausalLM", extra=dict()),
    "qwen3": dict(cls="Qwen3Config", model="Qwen3ForCausalLM", extra=dict(head_dim=16)),
}


def make_checkpoint(path: Path, arch: str = "llama", *, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, vocab: int = 96, seed: int = 0,
                    intermediate: int = 128, dtype: torch.dtype = torch.float32,
                    shards: int = 1) -> Path:
    """Write a random checkpoint of ``arch`` to ``path`` and return it."""
    import transformers

    spec = ARCH_CONFIGS[arch]
    config = getattr(transformers, spec["cls"])(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **spec["extra"],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, spec["model"])(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norms catch a missing/misplaced norm weight
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0, 0.1)
    max_shard = "1GB" if shards == 1 else f"{max(1, model.num_parameters() * 4 // shards // 1000)}KB"
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard)
    return path
