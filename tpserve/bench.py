"""Client benchmark: ``python -m tpserve.bench --server-url URL --max-tokens 256 --num-runs 5``.

Prints per run ``N tokens in Xs = Y tok/s (prompt: P toks)`` and an overall figure, the
shape users' own scripts print, so numbers can be compared directly.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

DEFAULT_PROMPTS = (
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(x):",
    "class Stack:\n    def __init__(self):",
    "# Read a CSV file and print the sum of each column\n",
    "def quicksort(items):",
)


@dataclass
class RunResult:
    tokens: int
    seconds: float
    prompt_tokens: int
    accept_length: float | None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def new_client() -> httpx.Client:
    """One pooled client per benchmark run: ``httpx.post`` builds a client (and an SSL
    context) per call, 30-50 ms of the benchmark's own CPU on the 2-core dev VM that was
    counted as the server's time (a 128-token request takes 250-400 ms there)."""
    return httpx.Client(timeout=600)


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int,
                temperature: float) -> RunResult:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens,
                                               "temperature": temperature, "ignore_eos": True}}
    start = time.perf_counter()
    r = client.post(url.rstrip("/") + "/generate", json=body)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return RunResult(meta["completion_tokens"], time.perf_counter() - start, meta["prompt_tokens"],
                     meta.get("spec_accept_length"))


def round_size(clients: int, per_client: int) -> int:
    """Requests in one round of ``clients`` closed-loop clients sending ``per_client`` each
    (one at a single client: a lone stream's round is one request)."""
    return clients * (1 if clients == 1 else max(1, per_client))


def round_prompts(prompts: Sequence[str], clients: int, per_client: int, first: int = 0
                  ) -> list[str]:
    """The prompts of one such round (``round_size``), cycling through ``prompts`` from
    ``first``."""
    return [prompts[(first + k) % len(prompts)] for k in range(round_size(clients, per_client))]


def run_batch(url: str, prompts: list[str], max_tokens: int, temperature: float,
              client: httpx.Client, clients: int | None = None) -> RunResult:
    """``prompts`` sent by ``clients`` concurrent clients on ``client`` (thread-safe, pooled
    connections), each sending the next prompt as soon as its last one is answered: a closed
    loop, like ``--max-concurrency`` in vLLM's and SGLang's serving benchmarks. By default one
    client per prompt (a burst). Tokens summed, time = wall time of the batch."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients or len(prompts)) as pool:
        outs = list(pool.map(lambda p: one_request(client, url, p, max_tokens, temperature),
                             prompts))
    accepts = [o.accept_length for o in outs if o.accept_length is not None]
    return RunResult(sum(o.tokens for o in outs), time.perf_counter() - start,
                     sum(o.prompt_tokens for o in outs) // len(outs),
                     sum(accepts) / len(accepts) if accepts else None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="tpserve.bench")
    ap.add_argument("--server-url", default="http://127.0.0.1:30000")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts-file", help="one prompt per line (default: built-in code prompts)")
    ap.add_argument("--json", help="write results to this file")
    args = ap.parse_args(argv)
    prompts = list(DEFAULT_PROMPTS)
    if args.prompts_file:
        prompts = [line.rstrip("\n").replace("\\n", "\n") for line in open(args.prompts_file) if line.strip()]

    def batch(i: int) -> list[str]:
        return [prompts[(i * args.concurrency + k) % len(prompts)] for k in range(args.concurrency)]

    print(f"Benchmarking {args.server_url}\n  max_tokens={args.max_tokens}, num_runs={args.num_runs}, "
          f"warmup={args.warmup}, concurrency={args.concurrency}\n")
    runs = []
    with new_client() as client:
        for i in range(args.warmup):
            w = run_batch(args.server_url, batch(i), min(args.max_tokens, 64), args.temperature,
                          client)
            print(f"  Warmup {i + 1}/{args.warmup} done ({w.tokens} tokens)")
        for i in range(args.num_runs):
            r = run_batch(args.server_url, batch(i), args.max_tokens, args.temperature, client)
            runs.append(r)
            extra = f", accept length {r.accept_length:.2f}" if r.accept_length else ""
            print(f"  Run {i + 1}/{args.num_runs}: {r.tokens} tokens in {r.seconds:.2f}s = "
                  f"{r.tok_s:.1f} tok/s (prompt: {r.prompt_tokens} toks{extra})")
    total_tokens, total_s = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
    summary = {"overall_tok_s": total_tokens / total_s if total_s else 0.0,
               "avg_tok_s": sum(r.tok_s for r in runs) / len(runs) if runs else 0.0,
               "min_tok_s": min((r.tok_s for r in runs), default=0.0),
               "max_tok_s": max((r.tok_s for r in runs), default=0.0),
               "runs": [asdict(r) for r in runs], "concurrency": args.concurrency}
    print("\n  ========== Results ==========")
    print(f"  Overall tok/s: {summary['overall_tok_s']:.1f}\n  Avg tok/s:     {summary['avg_tok_s']:.1f}\n"
          f"  Min tok/s:     {summary['min_tok_s']:.1f}\n  Max tok/s:     {summary['max_tok_s']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
