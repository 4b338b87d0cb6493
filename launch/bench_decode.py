"""Decode throughput at TP=1 against transformers and the memory-bandwidth limit.

``python -m launch.bench_decode [--batch 1 --tokens 128 --json FILE]`` builds a random
Llama-shaped checkpoint (hidden 512, 8 layers, vocab 32000, bf16), then measures in one run:
tpserve's engine decode tok/s, transformers' ``generate`` tok/s, and the limit set by reading
every weight once per step at the bandwidth of a large read-only reduction.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tpserve.args import ServerArgs
from tpserve.engine.request import Request
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine

SHAPE = dict(hidden=512, layers=8, heads=8, kv_heads=8, intermediate=1408, vocab=32000)


def make_checkpoint(path: Path) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["intermediate"],
        num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"], vocab_size=SHAPE["vocab"],
        max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of a large read-only reduction: the floor for streaming weights once."""
    data = torch.ones(nbytes // 4, dtype=torch.float32)
    data.sum()
    best = min(_timed(lambda: data.sum()) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes read per decode step: every weight except the embedding table (one row read)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "embed_tokens" not in n)


def tpserve_decode(path: Path, batch: int, tokens: int) -> tuple[float, int]:
    args = ServerArgs(model=str(path), dtype="bfloat16", allreduce="gloo", context_length=1024,
                      kv_cache_gb=0.25, device="cpu", max_running_requests=64,
                      cpu_threads=torch.get_num_threads())
    offline = OfflineEngine(args)
    engine, sched = offline.engine, offline.engine.scheduler
    params = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)

    def run(n: int) -> float:
        reqs: list[Request] = [offline.request([1, 2, 3, 4 + i], params, {}) for i in range(n)]
        for r in reqs:
            sched.add(r)
        engine.step(sched.next_batch())  # prefill, not timed
        start = time.perf_counter()
        while sched.has_work():
            engine.step(sched.next_batch())
        return sum(len(r.output_ids) - 1 for r in reqs) / (time.perf_counter() - start)

    run(batch)  # warm-up
    return run(batch), weight_bytes_per_token(offline.built.runner.model)


def transformers_decode(path: Path, batch: int, tokens: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 2, 3, 4 + i] for i in range(batch)])
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    model.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kwargs)
    return batch * tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="launch.bench_decode")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-transformers", action="store_true",
                    help="only tpserve (e.g. to compare TPSERVE_NATIVE_GEMM=0 runs)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = make_checkpoint(Path(tempfile.mkdtemp()) / "llama-512x8")
    ours, nbytes = tpserve_decode(path, args.batch, args.tokens)
    theirs = float("nan") if args.no_transformers else transformers_decode(path, args.batch,
                                                                            args.tokens)
    bw = read_bandwidth_gbs()
    limit = bw * 1e9 / nbytes * args.batch
    result = {"batch": args.batch, "tpserve_tok_s": ours, "transformers_tok_s": theirs,
              "bandwidth_gbs": bw, "weight_mb_per_step": nbytes / 1e6, "limit_tok_s": limit,
              "speedup_vs_transformers": ours / theirs, "fraction_of_limit": ours / limit,
              "threads": torch.get_num_threads()}
    print(f"{'engine':<14}{'tok/s':>10}{'vs HF':>8}{'of limit':>10}")
    print(f"{'tpserve':<14}{ours:>10.1f}{ours / theirs:>8.2f}{ours / limit:>10.0%}")
    print(f"{'transformers':<14}{theirs:>10.1f}{1.0:>8.2f}{theirs / limit:>10.0%}")
    print(f"{'bw limit':<14}{limit:>10.1f}   ({bw:.1f} GB/s, {nbytes / 1e6:.1f} MB/step)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
