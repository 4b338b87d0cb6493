"""Data for EAGLE-3 training: text the target writes itself, and the target's view of it.

The draft must imitate the target, so its training text is the target's own continuations
(greedy and sampled) of corpus prefixes. During training the target re-reads each sequence to
give the draft its inputs (three auxiliary hidden states per position) and its labels (the
target's next-token distribution).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tpserve.train.corpus import read_text


@dataclass(frozen=True)
class GeneratedData:
    tokens: torch.Tensor  # [N, T] int64: prompt + continuation
    lengths: torch.Tensor  # [N] tokens that are real text (continuations may end at </s>)


@dataclass(frozen=True)
class DraftVocab:
    ids: torch.Tensor  # [Vd] target ids of the draft vocab, ascending

    def d2t(self) -> torch.Tensor:
        return self.ids - torch.arange(self.ids.numel())

    def t2d(self, target_vocab: int) -> torch.Tensor:
        mask = torch.zeros(target_vocab, dtype=torch.bool)
        mask[self.ids] = True
        return mask


def load_target(path: Path, device: torch.device, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    return model


def corpus_prompts(tok: Tokenizer, files: tuple[Path, ...], count: int, min_len: int,
                   max_len: int, seed: int) -> list[list[int]]:
    """Prefixes cut at random line starts of random files (what a user might type)."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < count:
        text = read_text(rng.choice(files))
        starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
        start = rng.choice(starts[: max(1, len(starts) - 5)])
        ids = tok.encode(text[start : start + 8 * max_len], add_special_tokens=False).ids
        n = rng.randint(min_len, max_len)
        if len(ids) >= n:
            out.append(ids[:n])
    return out


@torch.no_grad()
def generate(model, prompts: list[list[int]], new_tokens: int, batch: int,  # type: ignore[no-untyped-def]
             temperature: float, eos_id: int, pad_id: int, progress=None) -> GeneratedData:
    """Continue ``prompts`` with the target; equal-length prompts batch without padding."""
    device = next(model.parameters()).device
    rows, lengths = [], []
    by_len: dict[int, list[list[int]]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    for plen in sorted(by_len):
        group = by_len[plen]
        for i in range(0, len(group), batch):
            ids = torch.tensor(group[i : i + batch], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=temperature > 0, temperature=temperature or None,
                                 top_k=None, top_p=None, pad_token_id=pad_id).cpu()
            for row in out:
                gen = row[plen:]
                hits = (gen == eos_id).nonzero()
                lengths.append(plen + (int(hits[0]) + 1 if len(hits) else len(gen)))
                rows.append(row)
            if progress is not None:
                progress.update(len(out))
    width = max(r.numel() for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : r.numel()] = r
    return GeneratedData(tokens, torch.tensor(lengths))


def choose_vocab(data: GeneratedData, target_vocab: int, size: int) -> DraftVocab:
    """The ``size`` most frequent tokens in the generated text (ties: lower id first)."""
    if size >= target_vocab:
        return DraftVocab(torch.arange(target_vocab))
    counts = torch.zeros(target_vocab, dtype=torch.long)
    for row, n in zip(data.tokens, data.lengths.tolist(), strict=True):
        counts += torch.bincount(row[:n], minlength=target_vocab)
    # Stable sort on -count keeps lower ids first among equals: a reproducible choice.
    order = torch.sort(-counts, stable=True).indices[:size]
    return DraftVocab(torch.sort(order).values)


@torch.no_grad()
def target_view(model, tokens: torch.Tensor, aux_ids: tuple[int, ...],  # type: ignore[no-untyped-def]
                draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features [B,T,3H] (outputs of layers ``aux_ids``, in that order), draft-vocab logits
    [B,T,Vd] and the full-vocab argmax [B,T]."""
    out = model(input_ids=tokens, output_hidden_states=True)
    # hidden_states[0] is the embedding output, so layer k's output is hidden_states[k + 1].
    feats = torch.cat([out.hidden_states[k + 1] for k in aux_ids], dim=-1)
    logits = out.logits
    return feats, logits[..., draft_ids].float(), logits.argmax(-1)
