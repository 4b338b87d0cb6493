"""Checks a checkpoint must pass before any weight is read, each refusal one ``ConfigError`` line.

Run on every rank, before the process group forms: every rank reaches the same verdict from
the same files, so a bad launch ends at once with exit code 2 instead of a traceback halfway
through loading (or ranks waiting on a peer that already died).
"""

from __future__ import annotations

import json
from pathlib import Path

from tpserve.args import ServerArgs
from tpserve.chat_template_files import load_chat_template
from tpserve.demo import demo_target
from tpserve.errors import ConfigError
from tpserve.generation_config import load_generation_config
from tpserve.models.config import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_QUANT_METHODS,
    ModelConfig,
    load_config,
)
from tpserve.server.tool_parsers import make_parser

TP_FLAG = "--nproc-per-node"
# Largest TP size listed as an alternative in a refusal (one host's worth of devices).
MAX_LISTED_TP = 64


def check_server_args(args: ServerArgs, tp_size: int) -> None:
    """The server's checks: ``args`` as resolved by ``model_path.resolve_args``."""
    model_dir = Path(args.model) if args.model else demo_target()
    if args.tool_call_parser is not None:
        try:
            make_parser(args.tool_call_parser)
        except ValueError as exc:
            raise ConfigError(str(exc), flag="--tool-call-parser") from None
    check_before_loading(load_config(model_dir), tp_size, model_dir,
                         Path(args.tokenizer) if args.tokenizer else model_dir,
                         args.chat_template, args.generation_config)


def check_before_loading(cfg: ModelConfig, tp_size: int, model_dir: Path,
                         tokenizer_dir: Path | None = None, chat_template: str | None = None,
                         generation_config: str = "auto") -> None:
    """Raise ConfigError for the first thing that would make loading or serving fail.

    ``tokenizer_dir`` None skips the tokenizer and chat-template checks (an offline engine
    may run without a tokenizer). ``chat_template`` / ``generation_config`` are the flags'
    values: both are read here (cheap), so a bad one is refused before the weights are.
    """
    check_architecture(cfg)
    check_quantization(cfg)
    check_weight_files(model_dir)
    check_tp_split(cfg, tp_size)
    if tokenizer_dir is not None:
        check_tokenizer_file(tokenizer_dir)
        load_chat_template(tokenizer_dir, model_dir, choice=chat_template, announce=False)
    load_generation_config(model_dir, generation_config)


def check_architecture(cfg: ModelConfig) -> None:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"architecture '{cfg.architecture}' is not served by tpserve "
                          f"(it serves: {', '.join(SUPPORTED_ARCHITECTURES)})", flag="--model")


def check_quantization(cfg: ModelConfig) -> None:
    quant = cfg.raw.get("quantization_config")
    if not quant:
        return
    method = str(quant.get("quant_method", "unknown")) if isinstance(quant, dict) else "unknown"
    if method not in SUPPORTED_QUANT_METHODS:
        readable = ", ".join(SUPPORTED_QUANT_METHODS) or "none"
        raise ConfigError(f"config.json's quantization_config.quant_method '{method}' is not "
                          f"read by tpserve (quantization methods it reads: {readable}; "
                          "unquantized checkpoints always work)", flag="--model")


def check_weight_files(model_dir: Path) -> None:
    """The safetensors weights: every shard the index names, else some ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ConfigError(f"{index} is not a safetensors index: {exc}", flag="--model") from None
        missing = [model_dir / s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ConfigError(f"missing weight file {missing[0]} (named by {index.name}"
                              + (f"; {len(missing) - 1} more missing)" if len(missing) > 1 else ")"),
                              flag="--model")
    elif not any(model_dir.glob("*.safetensors")):
        other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.gguf"))
        found = f" (found {', '.join(other[:3])}: tpserve reads safetensors only)" if other else ""
        raise ConfigError(f"missing weights: no {model_dir / 'model.safetensors'} and no other "
                          f"*.safetensors file{found}", flag="--model")


def check_tokenizer_file(tokenizer_dir: Path) -> None:
    tokenizer = tokenizer_dir / "tokenizer.json"
    if not tokenizer.is_file():
        raise ConfigError(f"missing tokenizer file {tokenizer}", flag="--tokenizer")


def tp_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """Why ``tp`` ranks cannot split this model (empty when they can).

    Attention heads and the MLP's intermediate size are split evenly; KV heads too, or, when
    there are fewer KV heads than ranks, each is replicated over ``tp / kv`` ranks
    (``QKVParallelLinear``). The vocabulary is padded to a multiple of ``tp``, so it never refuses.
    """
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"num_attention_heads ({cfg.num_heads}) is not divisible by the "
                        f"tensor-parallel size {tp}")
    kv = cfg.num_kv_heads
    if kv >= tp and kv % tp:
        problems.append(f"num_key_value_heads ({kv}) is not divisible by the tensor-parallel "
                        f"size {tp}")
    elif kv < tp and tp % kv:
        problems.append(f"the tensor-parallel size {tp} is not a multiple of "
                        f"num_key_value_heads ({kv}), so KV heads cannot be replicated evenly")
    if cfg.intermediate_size % tp:
        problems.append(f"intermediate_size ({cfg.intermediate_size}) is not divisible by the "
                        f"tensor-parallel size {tp}")
    return problems


def working_tp_sizes(cfg: ModelConfig, limit: int = MAX_LISTED_TP) -> list[int]:
    return [t for t in range(1, limit + 1) if not tp_problems(cfg, t)]


def check_tp_split(cfg: ModelConfig, tp_size: int) -> None:
    problems = tp_problems(cfg, tp_size)
    if problems:
        sizes = ", ".join(str(t) for t in working_tp_sizes(cfg))
        raise ConfigError(f"{problems[0]}; TP sizes that work for this model: {sizes} "
                          f"(torchrun {TP_FLAG} N)", flag=TP_FLAG)
