"""Train the demo target: a small Llama on the Python standard library's source.

``python -m tpserve.train.target --out DIR --minutes 28`` trains a byte-level BPE tokenizer
and a Llama-architecture model, then writes a normal Hugging Face directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json) plus
``train_log.json`` and ``loss.png``. Shapes keep TP = 1, 2, 4, 8 possible (8 heads).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tpserve.errors import exit_code_of
from tpserve.train.common import (
    Budget,
    Timer,
    lr_at,
    pick_device,
    plot_losses,
    progress_bar,
    setup_threads,
    write_json,
)
from tpserve.train.corpus import (
    SPECIALS,
    encode_files,
    fixed_windows,
    sample_windows,
    split_files,
    stdlib_files,
    train_tokenizer,
)


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 8
    intermediate_size: int = 352
    max_position: int = 2048  # trained on seq_len windows; rope extrapolates a little
    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    warmup: float = 0.03
    weight_decay: float = 0.1
    steps: int | None = None
    minutes: float | None = 38.0  # the shipped target: 2,898 steps on one quiet core
    eval_every: int = 100
    val_windows: int = 64
    val_fraction: float = 0.05
    max_files: int | None = 900  # ~5 M tokens: more than a CPU run gets through
    seed: int = 0
    device: str = "auto"
    threads: int | None = 1
    autocast_bf16: bool = False  # the demo used it (AMX CPU: faster than fp32)


def hf_config(cfg: TargetConfig):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=cfg.max_position,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_act="silu",
        attention_bias=False, mlp_bias=False)


def lm_loss(model: torch.nn.Module, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                             windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, autocast: bool, batch: int) -> float:
    model.eval()
    losses = [lm_loss(model, val[i : i + batch], autocast).item()
              for i in range(0, val.shape[0], batch)]
    model.train()
    return sum(losses) / len(losses)


def train(cfg: TargetConfig, out: Path) -> dict:
    device = pick_device(cfg.device)
    setup_threads(device, cfg.threads)
    torch.manual_seed(cfg.seed)
    timer = Timer()
    split = split_files(stdlib_files(), cfg.val_fraction, cfg.seed, cfg.max_files)
    tok = train_tokenizer(split.train, cfg.vocab_size)
    eos = tok.token_to_id("</s>")
    train_ids = encode_files(tok, split.train, eos)
    val = fixed_windows(encode_files(tok, split.val, eos), cfg.val_windows, cfg.seq_len + 1)
    prep_s = timer.elapsed()
    print(f"corpus: {len(split.train)} train files ({train_ids.numel():,} tokens), "
          f"{len(split.val)} val files; tokenizer + encoding {prep_s:.1f}s", flush=True)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config(cfg)).to(device)
    log = run_steps(cfg, model, train_ids, val.to(device), device)
    log.update(tokenizer_and_encode_s=round(prep_s, 1), train_tokens=int(train_ids.numel()),
               params=sum(p.numel() for p in model.parameters()))
    export(model, tok, cfg, out, log)
    return log


def run_steps(cfg: TargetConfig, model: torch.nn.Module, stream: torch.Tensor,
              val: torch.Tensor, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    budget, timer, step = Budget(cfg.steps, cfg.minutes), Timer(), 0
    curves: dict[str, list[tuple[int, float]]] = {"train": [], "val": []}
    bar = progress_bar(cfg.steps, "target")
    running = None
    while (progress := budget.progress(step, timer.elapsed())) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, cfg.lr, cfg.warmup)
        windows = sample_windows(stream, cfg.batch_size, cfg.seq_len + 1, gen).to(device)
        loss = lm_loss(model, windows, cfg.autocast_bf16)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 10 == 0:
            curves["train"].append((step, running))
        if step % cfg.eval_every == 0:
            curves["val"].append((step, evaluate(model, val, cfg.autocast_bf16, cfg.batch_size)))
        bar.update(1)
        bar.set_postfix(loss=f"{running:.3f}", pct=f"{100 * progress:.0f}%")
    bar.close()
    final_val = evaluate(model, val, cfg.autocast_bf16, cfg.batch_size)
    if not curves["val"] or curves["val"][-1][0] != step:
        curves["val"].append((step, final_val))
    return {"steps": step, "train_seconds": round(timer.elapsed(), 1),
            "final_train_loss": running, "final_val_loss": final_val, "curves": curves,
            "tokens_seen": step * cfg.batch_size * cfg.seq_len}


def export(model: torch.nn.Module, tok, cfg: TargetConfig, out: Path,  # type: ignore[no-untyped-def]
           log: dict) -> None:
    """Hugging Face directory in bf16 (what tpserve and ``transformers`` load)."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2],
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
        "model_max_length": cfg.max_position}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2))
    curves = log.pop("curves")
    plot_losses(out / "loss.png", curves, "demo target (stdlib source)")
    write_json(out / "train_log.json", {**log, "config": dataclasses.asdict(cfg),
                                        "curves": curves})


def parse_args(argv: list[str] | None = None) -> tuple[TargetConfig, Path]:
    parser = argparse.ArgumentParser(prog="python -m tpserve.train.target",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    for f in dataclasses.fields(TargetConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", default=f.default)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(flag, type=kind, default=f.default)
    ns = vars(parser.parse_args(argv))
    out = ns.pop("out")
    return TargetConfig(**ns), out


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_args(argv)
    log = train(cfg, out)
    print(f"done: {log['steps']} steps in {log['train_seconds']}s, "
          f"val loss {log['final_val_loss']:.4f} -> {out}")


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
