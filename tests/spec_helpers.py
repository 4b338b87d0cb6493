"""Shared fixtures for the speculative-decoding tests: checkpoints, engines, TP=2 runs."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpserve.args import ServerArgs

BASE = dict(allreduce="gloo", device="cpu", dtype="float32", max_total_tokens=4096,
            page_size=4, cpu_threads=1, chunked_prefill_size=16)


def args_for(target: Path, draft: Path | None = None, steps: int = 3, topk: int = 1,
             tokens: int = 4, **kw: Any) -> ServerArgs:
    # The settings given are pinned (adaptive off) unless a test asks for the chooser: these
    # tests check what one setting does, step by step.
    spec = {} if draft is None else dict(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
        speculative_num_steps=steps, speculative_eagle_topk=topk,
        speculative_num_draft_tokens=tokens, speculative_adaptive="off")
    return ServerArgs(model=str(target), **{**BASE, **spec, **kw})


def _rank_main(rank: int, world: int, store: str, fn: Callable[..., Any], arg: Any,
               out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        result = fn(arg)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def run_tp(world: int, fn: Callable[..., Any], arg: Any) -> Any:
    """Run ``fn(arg)`` on ``world`` spawned gloo ranks; return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "store"), fn, arg, out),
                 nprocs=world, join=True)
        return torch.load(out, weights_only=False)
