"""Test helpers: spawn a gloo process group, and drive the engine synchronously."""

from __future__ import annotations

import json
import os
import pickle
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tokenizers import Tokenizer

from launch.ports import free_port
from tpserve.args import ServerArgs
from tpserve.engine.build import BuiltEngine
from tpserve.engine.build import build_engine as build_rank
from tpserve.engine.engine import Engine
from tpserve.engine.request import Request, new_request
from tpserve.engine.sampling_params import SamplingParams
from tpserve.engine.warmup import run_to_completion


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # Plain pickle bytes: torch tensors sent through an mp queue live in shared memory
        # that vanishes when this process exits.
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, fn: Callable, *args: Any, timeout: float = 240) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return results by rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, status, value = out.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


SPECIALS = ("<s>", "</s>", "<pad>")


def byte_tokenizer_json() -> dict:
    """A byte-level BPE with no merges: every byte is a token, specials follow at 256+."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    added = [{"id": 256 + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def byte_tokenizer() -> Tokenizer:
    return Tokenizer.from_str(json.dumps(byte_tokenizer_json()))


def make_request(rid: str, ids: list[int], params: SamplingParams, eos: frozenset[int] = frozenset(),
                 seed: int = 0) -> Request:
    return new_request(rid, ids, params, byte_tokenizer(), eos, seed, lambda out: None)


def build(model_dir: Path, allreduce: str = "gloo", pages: int = 64, page_size: int = 4,
          max_running: int = 16, chunk: int = 64, dtype: str = "float32",
          context_length: int = 200, **kw: Any) -> BuiltEngine:
    """This rank's engine from the one builder, with a KV pool of exactly ``pages`` pages.

    Inside ``spawn`` the ranks come from the environment it sets; outside, TP = 1.
    """
    args = ServerArgs(model=str(model_dir), device="cpu", dtype=dtype, allreduce=allreduce,
                      page_size=page_size, max_total_tokens=(pages - 1) * page_size,
                      max_running_requests=max_running, chunked_prefill_size=chunk,
                      context_length=context_length, cpu_threads=1, **kw)
    return build_rank(args)


def build_engine(model_dir: Path, **kw: Any) -> Engine:
    """Rank 0's engine (TP = 1 unless inside ``spawn``)."""
    engine = build(model_dir, **kw).engine
    assert engine is not None
    return engine


def run_all(engine: Engine, reqs: list[Request]) -> list[list[int]]:
    """Drive the engine synchronously until every request finishes (raises if it stalls)."""
    run_to_completion(engine, reqs)
    return [r.output_ids for r in reqs]
