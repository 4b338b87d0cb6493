"""Load Hugging Face safetensors checkpoints into sharded parameters.

Every rank opens the files memory-mapped and reads only its own slice of each tensor through
``safe_open(...).get_slice``; a full tensor is never materialised on a rank (except the small
replicated ones: norms and biases of row-parallel layers).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tpserve.layers.linear import load_replicated

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint directory is missing files or tensors."""


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resolve_dtype(flag: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """``--dtype auto`` keeps the checkpoint dtype, except fp16 on CPU (slow there) -> bf16."""
    if flag != "auto":
        return DTYPES[flag]
    dtype = DTYPES.get(checkpoint_dtype.replace("torch.", ""), torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16
    return dtype


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(f"'{model_dir}' has no safetensors weights"
                              + (f" (missing {missing[0].name})" if missing else ""))
    return files


def iter_slices(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Yield (tensor name, lazily-sliceable handle) across all shard files."""
    with ExitStack() as stack:
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():
                yield name, handle.get_slice(name)


def load_weights(model: nn.Module, model_dir: str | Path, names: dict[str, tuple[str, int | None]],
                 optional: tuple[str, ...] = (), aliases: dict[str, str] | None = None) -> None:
    """Copy each checkpoint tensor's shard into ``model``.

    ``names`` maps checkpoint name -> (parameter name, shard id). Parameters listed in
    ``aliases`` (target -> source, e.g. tied lm_head -> embeddings) are filled from another
    checkpoint tensor. Every mapped parameter must be filled unless listed in ``optional``.
    """
    params = dict(model.named_parameters())
    aliases = aliases or {}
    wanted = {ckpt for ckpt in names if ckpt not in aliases}
    seen: set[str] = set()
    for ckpt_name, handle in iter_slices(safetensors_files(Path(model_dir))):
        targets = [ckpt_name] + [t for t, src in aliases.items() if src == ckpt_name]
        for target in targets:
            if target not in names:
                continue
            param_name, shard = names[target]
            param = params[param_name]
            loader = getattr(param, "weight_loader", load_replicated)
            loader(param, handle, shard)
            seen.add(target)
    missing = sorted(wanted - seen - set(optional))
    if missing:
        raise CheckpointError(f"checkpoint '{model_dir}' lacks tensor '{missing[0]}'"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
