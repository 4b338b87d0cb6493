"""The built-in training corpus: the Python standard library's own source files.

Present on every machine with Python, so the demo target trains without downloads. Files are
listed in sorted order and split into train / validation *by file* (a seeded shuffle), so
validation text is never seen in training, not even as a neighbouring window.
"""

from __future__ import annotations

import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2

# Pre-token boundaries: a word, a number or a punctuation run *keeps its trailing space*, and
# other whitespace (newline + indentation) stands alone. GPT-2's rule does the opposite (a
# space starts the next word), so a prompt ending in a space ("def ") ended in a lone space
# token that training text never contains before a name, and the model derailed. With
# trailing spaces attached, "def " is one token, exactly as it appears in the corpus.
PRETOKEN_PATTERN = r"[^\W\d]\w* ?|\d+ ?|[^\w\s]+ ?|\s+"


@dataclass(frozen=True)
class CorpusSplit:
    train: tuple[Path, ...]
    val: tuple[Path, ...]


def stdlib_files(root: str | None = None) -> list[Path]:
    base = Path(root or sysconfig.get_paths()["stdlib"])
    # site-packages holds whatever the user installed: not reproducible across machines.
    return sorted(p for p in base.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def split_files(files: list[Path], val_fraction: float, seed: int,
                max_files: int | None = None) -> CorpusSplit:
    order = list(files)
    random.Random(seed).shuffle(order)
    if max_files is not None:
        order = order[:max_files]
    n_val = max(1, int(len(order) * val_fraction))
    return CorpusSplit(train=tuple(sorted(order[n_val:])), val=tuple(sorted(order[:n_val])))


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: tuple[Path, ...], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte string is representable, no unknown token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((read_text(p) for p in files), trainer=trainer)
    return tok


def encode_files(tok: Tokenizer, files: tuple[Path, ...], eos_id: int) -> torch.Tensor:
    """One flat token stream, files separated by ``</s>`` (int32 to keep it compact)."""
    ids: list[int] = []
    texts = [read_text(p) for p in files]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def sample_windows(stream: torch.Tensor, batch: int, length: int,
                   gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``length`` tokens (int64) from ``stream``."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    offsets = torch.arange(length)
    return stream[starts[:, None] + offsets].long()


def fixed_windows(stream: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """Evenly spaced windows: a validation set that is identical on every call."""
    step = max(1, (stream.numel() - length) // count)
    starts = torch.arange(count) * step
    return stream[starts[:, None] + torch.arange(length)].long()


def heldout_files(target_dir: Path, seed: int) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """The target's own train / validation file split when it logged one (demo targets)."""
    log = target_dir / "train_log.json"
    tcfg = json.loads(log.read_text()).get("config", {}) if log.is_file() else {}
    split = split_files(stdlib_files(), float(tcfg.get("val_fraction", 0.05)),
                        int(tcfg.get("seed", seed)), tcfg.get("max_files"))
    return split.train, split.val
