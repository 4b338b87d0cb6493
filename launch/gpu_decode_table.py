"""GPU decode tok/s with and without CUDA graphs on a ~1B Llama-shaped random checkpoint.

``python -m launch.gpu_decode_table [--batches 1 8 32 --tokens 64 --json FILE]``: writes a
random bf16 checkpoint shaped like Llama-3.2-1B (hidden 2048, 16 layers, 32/8 heads,
intermediate 8192, vocab 128256, untied head), then decodes greedily at each batch size
eagerly and with CUDA graphs, and prints both against the HBM limit: weight bytes read per
step over the bandwidth of a large read-only reduction, x batch. Run by launch/gpu_check.sh.
``--attention-backend`` (default ``auto``: FlashInfer where installed, its CUDA-graph decode under
graphs) applies to both runs; the line after the table names the backend the graphs replayed.
Then where one batch's graph decode step goes (``--profile-batch``, default 1, 0 for none:
``launch.step_profile``), since graph decode reached only a quarter of the HBM limit at batch 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from launch.bench_compile import decode_rate
from launch.bench_decode import weight_bytes_per_token
from launch.step_profile import profile_decode
from tpserve.args import ServerArgs
from tpserve.offline import OfflineEngine

SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=8192, vocab_size=128256)


def write_checkpoint(path: Path) -> Path:
    """Random weights generated on the GPU (seconds, unlike a CPU transformers init)."""
    from safetensors.torch import save_file

    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = h // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
              "model.norm.weight": (h,)}
    for layer in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    gen = torch.Generator("cuda").manual_seed(0)
    tensors = {name: (torch.ones(s, device="cuda") if len(s) == 1 else
                      torch.randn(s, device="cuda", generator=gen) * 0.02).bfloat16().cpu()
               for name, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**SHAPE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1,
           "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def hbm_read_gbs(nbytes: int = 4 << 30, repeats: int = 5) -> float:
    data = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    data.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        data.sum()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best / 1e9


def measure(path: Path, batches: list[int], tokens: int, graphs: bool,
            attention: str = "auto", profile_batch: int = 0) -> dict[str, Any]:
    """tok/s per batch size; with ``profile_batch``, also where that batch's decode step goes
    (``launch.step_profile``)."""
    args = ServerArgs(model=str(path), device="cuda", dtype="bfloat16", allreduce="nccl",
                      attention_backend=attention,
                      context_length=2048, max_running_requests=max(batches),
                      cuda_graph_max_bs=max(batches), disable_cuda_graph=not graphs,
                      mem_fraction_static=0.6)
    engine = OfflineEngine(args)
    rates = {}
    for b in batches:
        decode_rate(engine, b, 8)  # warm-up
        rates[b] = decode_rate(engine, b, tokens)[0]
    profile = profile_decode(engine, profile_batch, 32) if profile_batch else None
    out = {"tok_s": rates, "graph_info": engine.built.runner.graph_info, "profile": profile,
           "kv_pages": engine.built.runner.kv.cfg.num_pages,
           "weight_bytes": weight_bytes_per_token(engine.built.runner.model)}
    engine.close()
    del engine
    gc.collect()  # the model's parameters sit in reference cycles (their bound loaders)
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="launch.gpu_decode_table")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--profile-batch", type=int, default=1,
                    help="profile one batch size's graph decode step (0: none)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    path = write_checkpoint(Path(tempfile.mkdtemp()) / "llama-1b-random")
    eager = measure(path, args.batches, args.tokens, False, args.attention_backend)
    graph = measure(path, args.batches, args.tokens, True, args.attention_backend,
                    args.profile_batch)
    bw = hbm_read_gbs()
    limit = {b: bw * 1e9 / eager["weight_bytes"] * b for b in args.batches}
    print(f"\n{'batch':>6}{'eager tok/s':>14}{'graphs tok/s':>14}{'speedup':>9}"
          f"{'HBM limit':>12}{'graphs/limit':>14}")
    for b in args.batches:
        e, g = eager["tok_s"][b], graph["tok_s"][b]
        print(f"{b:>6}{e:>14.1f}{g:>14.1f}{g / e:>8.2f}x{limit[b]:>12.1f}{g / limit[b]:>14.0%}")
    print(f"HBM read {bw:.0f} GB/s; {eager['weight_bytes'] / 1e9:.2f} GB weights per step; "
          f"KV pages eager {eager['kv_pages']} vs graphs {graph['kv_pages']}")
    print(f"graphs attention backend: {graph['graph_info'].get('attention')}; "
          f"graphs: {json.dumps(graph['graph_info'])}")
    if graph["profile"] is not None:
        print("\n".join(graph["profile"].lines()))
        graph["profile"] = asdict(graph["profile"])
    res = {"eager": eager, "graphs": graph, "hbm_gbs": bw, "limit_tok_s": limit}
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
