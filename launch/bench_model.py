"""The served benchmark's model: one random Llama checkpoint, servable and exported to GGUF.

``python -m launch.bench_model DIR`` writes DIR (``config.json``, ``model.safetensors``,
``tokenizer.json``: what ``python -m tpserve --model DIR`` needs) and ``DIR.gguf`` (the same
bf16 weights for llama.cpp), and reuses them when they already exist. The shape is issue 15's:
hidden 512 x 8 layers, 8 heads / 4 KV heads, MLP 1408, vocab 32000, bf16 — 79.9 MB of weights
read per decode step (everything but the embedding table). Random weights make the text
meaningless, not the timing: benchmarks use ``ignore_eos`` so every request runs its full length.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from launch.gguf_export import export, vocabulary


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1408
    vocab: int = 32000
    max_positions: int = 32768  # room for the 16K-token context figure plus its output


@dataclass(frozen=True)
class BenchModel:
    checkpoint: Path
    gguf: Path


def tokenizer_json(size: int) -> dict:
    """A tokenizer whose ids and strings are the GGUF's: one character per token.

    BPE without merges maps each character to its own id; unknown characters become <unk>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(vocabulary(size))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return json.loads(tok.to_str())


def write_checkpoint(path: Path, shape: ModelShape, seed: int = 0) -> None:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=shape.max_positions, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json(shape.vocab)))


def build(path: Path, shape: ModelShape = ModelShape()) -> BenchModel:
    """The checkpoint at ``path`` and its GGUF beside it, written unless already there."""
    path = Path(path)
    gguf = path.with_suffix(".gguf")
    needed = ("config.json", "model.safetensors", "tokenizer.json")
    if not all((path / name).is_file() for name in needed):
        path.mkdir(parents=True, exist_ok=True)
        write_checkpoint(path, shape)
        gguf.unlink(missing_ok=True)
    if not gguf.is_file():
        tmp = gguf.with_suffix(".gguf.tmp")
        export(path, tmp)
        tmp.rename(gguf)
    return BenchModel(path, gguf)


def weight_bytes_per_token(path: Path) -> int:
    """Bytes read per decode step: every tensor but the embedding table (one row of it)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if "embed_tokens" not in name:
                t = f.get_slice(name)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                total += numel * torch.finfo(getattr(torch, _dtype(t.get_dtype()))).bits // 8
    return total


def _dtype(safetensors_dtype: str) -> str:
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[safetensors_dtype]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="launch.bench_model")
    ap.add_argument("path", type=Path)
    model = build(ap.parse_args(argv).path)
    print(model.checkpoint)
    print(model.gguf)
    print(f"{weight_bytes_per_token(model.checkpoint) / 1e6:.1f} MB read per token")


if __name__ == "__main__":
    main()
