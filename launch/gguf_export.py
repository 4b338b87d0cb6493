"""Convert a Hugging Face Llama checkpoint (safetensors) to GGUF for llama.cpp comparisons.

``python -m launch.gguf_export CKPT_DIR OUT.gguf``. Weights keep their dtype (bf16 stays
BF16, so llama.cpp reads the same bytes per token as tpserve); 1-D norm weights are F32 as
llama.cpp expects. The q/k projections are permuted back from the Hugging Face rotate-half
(NeoX) row order to the interleaved-pair order llama.cpp's ``llama`` architecture rotates.
The vocabulary is a synthetic SentencePiece-style one (<unk>, <s>, </s>, 256 byte tokens,
then one distinct CJK or Hangul character per id, no space prefix): benchmarks feed token ids
directly, and a text made of those characters tokenizes to exactly one id per character in
llama.cpp and in the matching ``tokenizer.json`` (``launch.bench_model``), so both engines can
be given the same prompt as text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

TENSOR_MAP = {  # HF suffix -> GGUF name (per layer: prefixed with blk.{i}.)
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# One printable, non-space character per token: CJK Unified Ideographs, Hangul syllables, CJK
# Extension A (32164 + 6592 ids; Llama-2-sized vocabularies fit in the first two).
CHAR_RANGES = ((0x4E00, 0xA000), (0xAC00, 0xD7A4), (0x3400, 0x4DC0))
SPECIAL = ("<unk>", "<s>", "</s>")
GLOBAL_MAP = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def unpermute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate-half row order [x0..x(d/2-1), y0..] -> interleaved pairs [x0, y0, x1, y1, ...]."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_MAP:
        return GLOBAL_MAP[hf]
    _, _, layer, suffix = hf.split(".", 3)  # model.layers.{i}.suffix
    return f"blk.{layer}.{TENSOR_MAP[suffix]}"


def load_tensors(ckpt: Path, cfg: dict) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    if "lm_head.weight" not in tensors:  # tied embeddings
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    for name in list(tensors):
        if name.endswith("q_proj.weight"):
            tensors[name] = unpermute_rope(tensors[name], heads)
        elif name.endswith("k_proj.weight"):
            tensors[name] = unpermute_rope(tensors[name], kv_heads or heads)
    return tensors


def _as_numpy(t: torch.Tensor) -> tuple[np.ndarray, object]:
    import gguf

    if t.dim() == 1 or t.dtype == torch.float32:
        return t.float().numpy(), None
    if t.dtype == torch.bfloat16:  # numpy has no bf16: hand gguf the raw 16-bit words
        return t.contiguous().view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    return t.half().numpy(), None


def vocabulary(size: int) -> list[str]:
    """Token strings by id: the specials, the 256 byte tokens, then one character per id."""
    chars = (chr(c) for lo, hi in CHAR_RANGES for c in range(lo, hi))
    tokens = [*SPECIAL, *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [next(chars) for _ in range(size - len(tokens))]
    return tokens


def write_metadata(writer: object, cfg: dict) -> None:
    import gguf

    w: gguf.GGUFWriter = writer  # type: ignore[assignment]
    heads = cfg["num_attention_heads"]
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    vocab = cfg["vocab_size"]
    tokens = vocabulary(vocab)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)  # else every text would start with a byte-fallback "\u2581"


def export(ckpt: Path, out: Path) -> Path:
    import gguf

    cfg = json.loads((ckpt / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(ckpt.name)
    write_metadata(writer, cfg)
    for name, tensor in load_tensors(ckpt, cfg).items():
        if "rotary_emb" in name:
            continue
        array, raw_dtype = _as_numpy(tensor)
        writer.add_tensor(gguf_name(name), array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="launch.gguf_export")
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    print(export(args.checkpoint, args.out))


if __name__ == "__main__":
    main()
