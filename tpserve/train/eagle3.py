"""Train an EAGLE-3 draft for a target: ``python -m tpserve.train.eagle3 --target DIR --out DIR``.

1. The target continues corpus prefixes (greedy and sampled): that text is the training data.
2. The draft vocabulary is the most frequent tokens of that text (``d2t`` / ``t2d``).
3. Training-time test: each batch unrolls ``ttt_steps`` draft steps, each feeding back the
   draft's own hidden states; the loss is the soft cross-entropy against the target's
   distribution over the draft vocabulary, step k weighted ``decay ** k``.
4. Export in the published EAGLE-3 format, then measure accept length per position with
   tpserve's own speculative decoding on held-out prompts (``tpserve.train.evaluate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tpserve.errors import ConfigError, exit_code_of
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
from tpserve.train.corpus import heldout_files
from tpserve.train.draft_model import DraftShape, Eagle3Trainable
from tpserve.train.eagle_data import (
    DraftVocab,
    GeneratedData,
    choose_vocab,
    corpus_prompts,
    generate,
    load_target,
    target_view,
)
from tpserve.train.eagle_export import (
    capturable_aux_ids,
    default_aux_ids,
    export_draft,
    load_exported,
)
from tpserve.train.evaluate import accept_eval, eval_prompts


@dataclass(frozen=True)
class DraftTrainConfig:
    draft_vocab: int = 1024
    intermediate_size: int | None = None  # default: the target's
    ttt_steps: int = 4
    decay: float = 0.8
    prompts: int = 4096
    prompt_min: int = 8
    prompt_max: int = 32
    new_tokens: int = 96
    greedy_fraction: float = 0.5
    temperature: float = 0.8
    gen_batch: int = 64
    batch_size: int = 16
    lr: float = 3e-3
    warmup: float = 0.05
    steps: int | None = None
    minutes: float | None = 20.0  # the shipped draft: 1,646 steps on one core
    checkpoint_every: int = 200
    eval_prompts: int = 16
    eval_tokens: int = 64
    seed: int = 0
    device: str = "auto"
    threads: int | None = 2
    target_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    init_from: str | None = None  # warm start from an exported draft: its weights and vocab
    # Target layer outputs the draft reads, comma-separated ("" = ``default_aux_ids``).
    aux_layers: str = ""


def make_data(cfg: DraftTrainConfig, model, tok: Tokenizer,  # type: ignore[no-untyped-def]
              files: tuple[Path, ...]) -> GeneratedData:
    prompts = corpus_prompts(tok, files, cfg.prompts, cfg.prompt_min, cfg.prompt_max, cfg.seed)
    n_greedy = int(len(prompts) * cfg.greedy_fraction)
    eos, pad = _special(tok, "</s>"), _special(tok, "<pad>")
    bar = progress_bar(len(prompts), "generate")
    parts = [generate(model, chunk, cfg.new_tokens, cfg.gen_batch, temp, eos, pad, bar)
             for chunk, temp in ((prompts[:n_greedy], 0.0), (prompts[n_greedy:], cfg.temperature))
             if chunk]
    bar.close()
    width = max(p.tokens.shape[1] for p in parts)
    tokens = torch.cat([torch.nn.functional.pad(p.tokens, (0, width - p.tokens.shape[1]), value=pad)
                        for p in parts])
    return GeneratedData(tokens, torch.cat([p.lengths for p in parts]))


def _special(tok: Tokenizer, name: str) -> int:
    found = tok.token_to_id(name)
    return int(found) if found is not None else 0


def ttt_loss(draft: Eagle3Trainable, target, embed: torch.Tensor, tokens: torch.Tensor,  # type: ignore[no-untyped-def]
             lengths: torch.Tensor, vocab: DraftVocab, aux_ids: tuple[int, ...],
             cfg: DraftTrainConfig) -> tuple[torch.Tensor, list[float], list[float]]:
    """Weighted TTT loss over one batch, plus per-step loss and top-1 agreement."""
    t2d = vocab.t2d(embed.shape[0]).to(tokens.device)
    feats, tgt_logits, tgt_argmax = target_view(target, tokens, aux_ids, vocab.ids.to(tokens.device))
    rows = tokens.shape[1] - 1  # row i pairs embed(token i+1) with feature i
    padded = torch.nn.functional.pad(tokens, (0, cfg.ttt_steps))
    embeds = [embed[padded[:, 1 + k : 1 + k + rows]].float() for k in range(cfg.ttt_steps)]
    logits = draft.unrolled(embeds, feats[:, :rows].float())
    pos = torch.arange(rows, device=tokens.device)
    total = torch.zeros((), device=tokens.device)
    losses, accs = [], []
    for k, lg in enumerate(logits):
        at = (pos + 1 + k).clamp(max=tokens.shape[1] - 1)  # the target position step k predicts from
        valid = (pos[None] + 1 + k < lengths[:, None]) & t2d[tgt_argmax[:, at]]
        target_p = torch.softmax(tgt_logits[:, at], dim=-1)
        ce = -(target_p * torch.log_softmax(lg.float(), dim=-1)).sum(-1)
        denom = valid.sum().clamp(min=1)
        step_loss = (ce * valid).sum() / denom
        total = total + cfg.decay**k * step_loss
        agree = (lg.argmax(-1) == tgt_logits[:, at].argmax(-1)) & valid
        losses.append(step_loss.item())
        accs.append((agree.sum() / denom).item())
    return total, losses, accs


def init_draft(shape: DraftShape, target, vocab: DraftVocab) -> Eagle3Trainable:  # type: ignore[no-untyped-def]
    """Random midlayer; norm and head start as the target's (restricted to the draft vocab)."""
    draft = Eagle3Trainable(shape)
    with torch.no_grad():
        draft.norm.weight.copy_(target.model.norm.weight.float())
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab.ids].float())
    return draft


def aux_layer_ids(spec: str, num_layers: int) -> tuple[int, ...]:
    """The target layers whose outputs feed the draft: ``spec`` ("1,3,6") or the default.
    Three distinct ids in 0..L - 2 (the engine captures raw residual outputs; Hugging Face's
    last hidden state is already final-normed)."""
    if not spec:
        return default_aux_ids(num_layers)
    try:
        ids = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise ConfigError(f"--aux-layers wants comma-separated layer ids (got {spec!r})",
                          flag="--aux-layers") from None
    if not capturable_aux_ids(ids, num_layers):
        raise ConfigError(f"--aux-layers wants three distinct ids in 0..{num_layers - 2} "
                          f"(got {spec!r})", flag="--aux-layers")
    return ids


def draft_shape(target_cfg: dict, cfg: DraftTrainConfig, vocab: DraftVocab) -> DraftShape:
    h = target_cfg["hidden_size"]
    heads = target_cfg["num_attention_heads"]
    return DraftShape(
        hidden_size=h, num_heads=heads,
        num_kv_heads=target_cfg.get("num_key_value_heads") or heads,
        intermediate_size=cfg.intermediate_size or target_cfg["intermediate_size"],
        draft_vocab_size=int(vocab.ids.numel()), target_hidden_size=h,
        rms_norm_eps=float(target_cfg.get("rms_norm_eps", 1e-6)),
        # transformers >= 5 nests rope_theta under rope_parameters.
        rope_theta=float((target_cfg.get("rope_parameters") or {}).get(
            "rope_theta", target_cfg.get("rope_theta", 10000.0))))


def train_loop(cfg: DraftTrainConfig, draft: Eagle3Trainable, target, data: GeneratedData,  # type: ignore[no-untyped-def]
               vocab: DraftVocab, aux_ids: tuple[int, ...], save) -> dict:
    device = next(target.parameters()).device
    embed = target.get_input_embeddings().weight.detach()
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    budget, timer, step = Budget(cfg.steps, cfg.minutes), Timer(), 0
    curves: dict[str, list[tuple[int, float]]] = {f"step {k}": [] for k in range(cfg.ttt_steps)}
    accs: list[float] = []
    bar = progress_bar(cfg.steps, "draft")
    while (progress := budget.progress(step, timer.elapsed())) < 1.0:
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, cfg.lr, cfg.warmup)
        pick = torch.randint(0, data.tokens.shape[0], (cfg.batch_size,), generator=gen)
        loss, losses, accs = ttt_loss(draft, target, embed, data.tokens[pick].to(device),
                                      data.lengths[pick].to(device), vocab, aux_ids, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            for k, value in enumerate(losses):
                curves[f"step {k}"].append((step, value))
        if step % cfg.checkpoint_every == 0:
            save("checkpoint")
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{accs[0]:.2f}")
    bar.close()
    return {"steps": step, "train_seconds": round(timer.elapsed(), 1), "curves": curves,
            "final_step_losses": [v[-1][1] for v in curves.values() if v],
            "final_step_top1": accs}


def train(cfg: DraftTrainConfig, target_dir: Path, out: Path) -> dict:
    device = pick_device(cfg.device)
    setup_threads(device, cfg.threads)
    torch.manual_seed(cfg.seed)
    dtype_name = cfg.target_dtype if cfg.target_dtype != "auto" else (
        "bfloat16" if device.type == "cuda" else "float32")
    target = load_target(target_dir, device, getattr(torch, dtype_name))
    target_cfg = json.loads((target_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    train_files, val_files = heldout_files(target_dir, cfg.seed)
    timer = Timer()
    data = make_data(cfg, target, tok, train_files)
    gen_seconds = timer.elapsed()
    vocab = choose_vocab(data, target_cfg["vocab_size"], cfg.draft_vocab)
    aux_ids = aux_layer_ids(cfg.aux_layers, target_cfg["num_hidden_layers"])
    draft = init_draft(draft_shape(target_cfg, cfg, vocab), target, vocab)
    if cfg.init_from:
        vocab = load_exported(draft, Path(cfg.init_from))
    draft = draft.to(device)

    def save(name: str | None) -> Path:
        return export_draft(draft, vocab, aux_ids, target_cfg, out / name if name else out)

    log = train_loop(cfg, draft, target, data, vocab, aux_ids, save)
    save(None)
    log.update(generate_seconds=round(gen_seconds, 1),
               generated_tokens=int(data.lengths.sum()), aux_layer_ids=list(aux_ids),
               draft_params=sum(p.numel() for p in draft.parameters()))
    curves = log.pop("curves")
    plot_losses(out / "loss.png", curves, "EAGLE-3 draft: TTT loss per unrolled step")
    write_json(out / "train_log.json", {**log, "config": dataclasses.asdict(cfg),
                                        "curves": curves})
    if cfg.eval_prompts:
        prompts = eval_prompts(tok, val_files, cfg.eval_prompts, cfg.seed + 1)
        log["eval"] = accept_eval(target_dir, out, prompts, cfg.eval_tokens, cfg.device)
        write_json(out / "eval.json", log["eval"])
    return log


def parse_args(argv: list[str] | None = None) -> tuple[DraftTrainConfig, Path, Path]:
    parser = argparse.ArgumentParser(prog="python -m tpserve.train.eagle3",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    for f in dataclasses.fields(DraftTrainConfig):
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    ns = vars(parser.parse_args(argv))
    target, out = ns.pop("target"), ns.pop("out")
    return DraftTrainConfig(**ns), target, out


def main(argv: list[str] | None = None) -> None:
    cfg, target, out = parse_args(argv)
    log = train(cfg, target, out)
    print(f"done: {log['steps']} steps in {log['train_seconds']}s; per-step loss "
          f"{[round(x, 3) for x in log['final_step_losses']]} -> {out}")
    if "eval" in log:
        print(json.dumps(log["eval"], indent=2))


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
