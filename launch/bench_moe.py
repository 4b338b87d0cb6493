"""DeepSeek-V3-shaped MoE + MLA decode on CPU: tok/s, allreduces per step, where time goes.

``python -m launch.bench_moe [--tokens 32 --batch 1 --tp 1 2 --fp8 --json FILE]`` builds a random
bf16 checkpoint shaped like DeepSeek-V3 in miniature (hidden 512, 4 layers with the first
dense, 16 routed experts top-4 in 2 groups, 1 shared expert, MLA with kv_lora_rank 128,
rope 32, q_lora 192), then for each TP size runs the engine (one torch thread per rank) and
reports decode tok/s, allreduces per decode step (comm stats), and rank 0's exclusive time
per scope: attention (MLA), routing, expert dispatch (sort/gather/scatter), expert matmuls,
shared experts, dense MLP, allreduce, LM head, rest.

Two micro tables justify defaults: the expert compute paths (sorted per-expert slices,
static all-experts, per-pair weight gather + bmm) by token count, and MLA's absorbed vs
expanded attention by queries per step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from launch.bench_moe_parts import (
    ScopeTimer,
    expert_path_table,
    install_timers,
    mla_path_table,
    print_table,
)
from launch.ports import free_port

SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
             num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8,
             n_routed_experts=16, num_experts_per_tok=4, n_group=2, topk_group=1,
             n_shared_experts=1, kv_lora_rank=128, qk_rope_head_dim=32, q_lora_rank=192,
             qk_nope_head_dim=64, v_head_dim=64, vocab_size=8192, max_position_embeddings=2048)


def make_checkpoint(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPE))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def _decode(engine: Any, timer: ScopeTimer, batch: int, tokens: int) -> dict[str, Any]:
    from tpserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.request([1, 2, 3, 4 + i], params, {}) for i in range(batch)]
    sched = engine.engine.scheduler
    for r in reqs:
        sched.add(r)
    engine.engine.step(sched.next_batch())  # prefill, not timed
    comm = engine.built.runner.comm
    comm.reset_stats()
    timer.reset()
    steps, start = 0, time.perf_counter()
    while sched.has_work():
        engine.engine.step(sched.next_batch())
        steps += 1
    seconds = time.perf_counter() - start
    calls = sum(s["calls"] for s in comm.stats().values())
    return {"tok_s": batch * steps / seconds, "steps": steps, "step_ms": 1e3 * seconds / steps,
            "allreduces_per_step": calls / steps,
            "scope_share": timer.shares(seconds), "scope_ms_per_step": timer.per_step(steps)}


def _rank(rank: int, world: int, port: int, model: str, batch: int, tokens: int,
          allreduce: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from tpserve.args import ServerArgs
    from tpserve.offline import OfflineEngine

    args = ServerArgs(model=model, dtype="bfloat16", allreduce=allreduce if world > 1 else "gloo",
                      cpu_threads=1, kv_cache_gb=0.25, context_length=1024,
                      max_total_tokens=8192)
    engine = OfflineEngine(args)
    timer = install_timers(engine.built.runner.model, engine.built.runner.comm)
    if rank != 0:
        engine.follow()
        return
    _decode(engine, timer, batch, 4)  # warm-up
    result = _decode(engine, timer, batch, tokens)
    engine.close()
    Path(out).write_text(json.dumps(result))


def run_tp(world: int, model: Path, batch: int, tokens: int, allreduce: str) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank, args=(world, port, str(model), batch, tokens, allreduce, out),
                 nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="launch.bench_moe")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--allreduce", default="shm")
    ap.add_argument("--fp8", action="store_true",
                    help="also run an FP8 block-quantised copy (128x128) at each TP size")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp())
    model = make_checkpoint(root / "deepseek-mini")
    runs = [(str(w), w, model) for w in args.tp]
    if args.fp8:
        from tests.moe_checkpoints import make_fp8_copy

        make_fp8_copy(model, root / "fp8", root / "fp8-dequantised", (128, 128))
        runs += [(f"{w} fp8", w, root / "fp8") for w in args.tp]
    results: dict[str, Any] = {"shape": SHAPE, "batch": args.batch, "tp": {}}
    for label, world, path in runs:
        results["tp"][label] = run_tp(world, path, args.batch, args.tokens, args.allreduce)
    print_table(results)
    if not args.skip_micro:
        torch.set_num_threads(1)
        results["expert_paths_ms"] = expert_path_table(SHAPE)
        results["mla_paths_ms"] = mla_path_table(SHAPE)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
