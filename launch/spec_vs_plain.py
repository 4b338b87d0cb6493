"""Speculation against plain decoding on two live servers, in alternating rounds.

``python -m launch.spec_vs_plain --plain URL --spec URL --concurrency 1,8 --rounds 5``
runs, per round and concurrency, one batch on each server (the order flips every round so
a slow moment of a shared machine hits both sides alike), then prints the median tok/s of
each, the median of the per-round ratios and the ratio of the totals (all tokens over all
time), and writes JSON with ``--json``.

Clients: at a concurrency C above 1 a round is C clients sending ``--requests-per-client``
requests each, every client its next one as soon as the last is answered (a closed loop, as
``--max-concurrency`` in vLLM's and SGLang's serving benchmarks); ``--requests-per-client 1``
is one burst of C requests, whose time is that of the slowest (a speculative server's requests
advance at their own acceptance, so its burst ends with a tail of a few stragglers that a
plain server's equal-length burst does not have). At concurrency 1 a round is one request.

Prompts: by default each round takes the next ``concurrency`` built-in prompts, so batch 1
cycles through all of them (how far a draft gets depends a lot on the text: on the demo pair
one prompt speculates at 0.9x plain and another at 1.6x); ``--same-prompts`` gives every
round the first ones (what this tool did before, batch 1 measuring one prompt only). At
batch 1 the report also gives each prompt's median ratio (``by_prompt``): the overall median
is mostly which prompts the draft does well on.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import httpx

from tpserve.bench import DEFAULT_PROMPTS, new_client, round_prompts, round_size, run_batch


def one_round(client: httpx.Client, urls: dict[str, str], conc: int, tokens: int, flip: bool,
              first: int = 0, per_client: int = 1) -> dict[str, float]:
    """One batch on each server (``conc`` clients, ``per_client`` requests each); tok/s per
    server and, under ``seconds``, the wall times."""
    prompts = round_prompts(DEFAULT_PROMPTS, conc, per_client, first)
    order = list(urls.items())[::-1] if flip else list(urls.items())
    out: dict[str, float] = {}
    for name, url in order:
        run = run_batch(url, prompts, tokens, 0.0, client, conc)
        out[name] = run.tokens / run.seconds
        out[f"{name}_tokens"], out[f"{name}_seconds"] = run.tokens, run.seconds
    return out


def by_prompt(rounds: list[dict[str, float]], firsts: list[int]) -> dict[str, float]:
    """Batch 1: each prompt's median spec / plain ratio over the rounds that ran it, keyed by
    its index in ``DEFAULT_PROMPTS``."""
    ratios: dict[int, list[float]] = {}
    for r, first in zip(rounds, firsts, strict=True):
        ratios.setdefault(first % len(DEFAULT_PROMPTS), []).append(r["spec"] / r["plain"])
    return {str(k): statistics.median(v) for k, v in sorted(ratios.items())}


def totals_ratio(rounds: list[dict[str, float]]) -> float:
    """Speculative over plain tok/s, each as all its tokens over all its time."""
    def rate(name: str) -> float:
        return (sum(r[f"{name}_tokens"] for r in rounds)
                / sum(r[f"{name}_seconds"] for r in rounds))
    return rate("spec") / rate("plain")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="launch.spec_vs_plain", description=__doc__.split("\n")[0])
    ap.add_argument("--plain", required=True, help="URL of the server without speculation")
    ap.add_argument("--spec", required=True, help="URL of the speculative server")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=4,
                    help="at concurrency > 1, requests each client sends per round, the next "
                         "as soon as the last is answered (1: one burst)")
    ap.add_argument("--same-prompts", action="store_true",
                    help="every round the first prompts (default: each round the next ones)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    urls = {"plain": args.plain.rstrip("/"), "spec": args.spec.rstrip("/")}
    report: dict[str, Any] = {}
    with new_client() as client:
        for conc in (int(c) for c in args.concurrency.split(",")):
            per = args.requests_per_client
            for i in range(args.warmup):
                one_round(client, urls, conc, args.max_tokens, i % 2 == 1, 0, per)
            count = round_size(conc, per)
            firsts = [0 if args.same_prompts else i * count for i in range(args.rounds)]
            rounds = [one_round(client, urls, conc, args.max_tokens, i % 2 == 1, first, per)
                      for i, first in enumerate(firsts)]
            row = {"plain_tok_s": statistics.median(r["plain"] for r in rounds),
                   "spec_tok_s": statistics.median(r["spec"] for r in rounds),
                   "ratio_median": statistics.median(r["spec"] / r["plain"] for r in rounds),
                   "ratio_totals": totals_ratio(rounds), "rounds": rounds}
            if conc == 1:
                row["by_prompt"] = by_prompt(rounds, firsts)
            report[str(conc)] = row
            print(f"c={conc:3d}  plain {row['plain_tok_s']:8.1f} tok/s  spec {row['spec_tok_s']:8.1f}"
                  f" tok/s  spec/plain median of rounds {row['ratio_median']:.2f}x, of totals "
                  f"{row['ratio_totals']:.2f}x", flush=True)
            if conc == 1:
                print("       by prompt (median of its rounds): " + ", ".join(
                    f"#{k} {v:.2f}x" for k, v in row["by_prompt"].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
