"""Batched greedy decode through llama.cpp's C API (``llama-cpp-python`` low-level bindings).

B sequences decode together: each ``llama_decode`` call carries one token per sequence (its
own seq_id), the same shape as a tpserve decode step, and the argmax of every row's logits
becomes that sequence's next token. A fresh context per batch size keeps runs independent.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import llama_cpp as L  # noqa: N812 - the C API's own prefix
import numpy as np


def _fn(*names: str) -> Any:
    """The first binding that exists (the C API renamed several functions across versions)."""
    for name in names:
        if hasattr(L, name):
            return getattr(L, name)
    raise ImportError(f"llama_cpp has none of {names}")


# llama.cpp logs every load to stderr; the callback must outlive the process's calls.
_SILENT = L.llama_log_callback(lambda level, text, user: None)


def _load(gguf: Path) -> Any:
    L.llama_log_set(_SILENT, ctypes.c_void_p())
    L.llama_backend_init()
    params = L.llama_model_default_params()
    model = _fn("llama_model_load_from_file", "llama_load_model_from_file")(
        str(gguf).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    return model


def _context(model: Any, batch: int, threads: int) -> Any:
    params = L.llama_context_default_params()
    params.n_ctx = 256 * batch
    params.n_batch = params.n_ubatch = max(64, 8 * batch)
    params.n_seq_max = batch
    params.n_threads = params.n_threads_batch = threads
    ctx = _fn("llama_init_from_model", "llama_new_context_with_model")(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    return ctx


def _vocab_size(model: Any) -> int:
    if hasattr(L, "llama_model_get_vocab") and hasattr(L, "llama_vocab_n_tokens"):
        return int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
    return int(L.llama_n_vocab(model))


def _decode(ctx: Any, batch: Any, tokens: list[list[int]], pos: list[int], vocab: int
            ) -> np.ndarray:
    """Feed tokens[s] at positions pos[s].. for every sequence s; argmax of each last row."""
    n = 0
    last = []
    for seq, toks in enumerate(tokens):
        for j, tok in enumerate(toks):
            batch.token[n], batch.pos[n] = tok, pos[seq] + j
            batch.n_seq_id[n], batch.seq_id[n][0] = 1, seq
            batch.logits[n] = j == len(toks) - 1
            n += 1
        last.append(n - 1)
    batch.n_tokens = n
    if L.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    rows = len(tokens)  # only rows with logits=True are output, in batch order
    ptr = ctypes.cast(L.llama_get_logits(ctx), ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(ptr, shape=(rows, vocab)).argmax(axis=1)


def decode_rate(model: Any, batch: int, steps: int, threads: int) -> float:
    vocab = _vocab_size(model)
    ctx = _context(model, batch, threads)
    buf = L.llama_batch_init(max(64, 8 * batch), 0, 1)
    try:
        prompts = [[1, 2, 3, 4 + i] for i in range(batch)]
        nxt = _decode(ctx, buf, prompts, [0] * batch, vocab)  # prefill, not timed
        pos = [len(p) for p in prompts]
        start = time.perf_counter()
        for _ in range(steps):
            nxt = _decode(ctx, buf, [[int(t)] for t in nxt], pos, vocab)
            pos = [p + 1 for p in pos]
        return batch * steps / (time.perf_counter() - start)
    finally:
        L.llama_batch_free(buf)
        L.llama_free(ctx)


class LlamaCpp:
    """A loaded GGUF model; ``decode_rate`` builds a fresh context per call."""

    def __init__(self, gguf: Path) -> None:
        self.model = _load(gguf)

    def decode_rate(self, batch: int, steps: int, threads: int) -> float:
        decode_rate(self.model, batch, 4, threads)  # warm-up (allocations, repacking)
        return decode_rate(self.model, batch, steps, threads)

    def close(self) -> None:
        _fn("llama_model_free", "llama_free_model")(self.model)
