"""Bounded soak test: C streaming clients for T minutes against a local tpserve server.

    python -m launch.soak --url http://127.0.0.1:30000 --concurrency 8 --minutes 5

Loopback only (it refuses other hosts) and it stops by itself after ``--minutes``. Each
client loops over /v1/completions streams with mixed prompt lengths. The report: requests
completed, errors (by kind), p50/p99 time to first token and inter-token latency, output
tokens/s, and the server's resident memory (summed over the rank pids from
/get_server_info, read from /proc) at the start and the end, to spot leaks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Tally:
    completed: int = 0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def rank_rss_mb(pid: int) -> float:
    """VmRSS of one process (this host only, hence loopback); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def rss_mb(pids: list[int]) -> float:
    """Sum of VmRSS over the rank processes."""
    return sum(rank_rss_mb(pid) for pid in pids)


async def sample_rss(pids: list[int], every_s: float, deadline: float,
                     series: list[tuple[float, list[float]]]) -> None:
    """Per-rank RSS every ``every_s`` seconds: shows whether growth levels off or keeps going."""
    start = time.monotonic()
    while time.monotonic() < deadline:
        series.append((round(time.monotonic() - start, 1), [round(rank_rss_mb(p), 1) for p in pids]))
        await asyncio.sleep(every_s)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one_request(client: httpx.AsyncClient, rng: random.Random, max_tokens: int,
                      tally: Tally) -> None:
    prompt = "soak " * rng.choice([1, 4, 16, 40])  # mixed prompt lengths
    body = {"prompt": prompt, "max_tokens": rng.randint(max_tokens // 4, max_tokens),
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True}}
    start, last, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            tally.errors[f"http {r.status_code}"] += 1
            await r.aread()
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):  # the last chunk: exact token count
                tokens = chunk["usage"]["completion_tokens"]
                continue
            now = time.perf_counter()  # chunks: one per token unless text was held back
            if last is None:
                tally.ttft.append(now - start)
            else:
                tally.itl.append(now - last)
            last = now
    tally.completed += 1
    tally.tokens += tokens


async def client_loop(url: str, headers: dict[str, str], seed: int, deadline: float,
                      max_tokens: int, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        while time.monotonic() < deadline:
            try:
                await one_request(client, rng, max_tokens, tally)
            except httpx.HTTPError as exc:
                tally.errors[type(exc).__name__] += 1
                await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace) -> dict[str, object]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    info = httpx.get(args.url + "/get_server_info", headers=headers, timeout=30).json()
    pids = info.get("rank_pids", [])
    rss_start, tally = rss_mb(pids), Tally()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    series: list[tuple[float, list[float]]] = []
    await asyncio.gather(sample_rss(pids, args.rss_every_s, deadline, series),
                         *(client_loop(args.url, headers, i, deadline, args.max_tokens, tally)
                           for i in range(args.concurrency)))
    elapsed = time.monotonic() - start
    ms = lambda v: None if v is None else round(v * 1000, 2)  # noqa: E731
    return {
        "concurrency": args.concurrency, "seconds": round(elapsed, 1),
        "requests_completed": tally.completed, "errors": dict(tally.errors),
        "ttft_ms_p50": ms(percentile(tally.ttft, 0.5)), "ttft_ms_p99": ms(percentile(tally.ttft, 0.99)),
        "itl_ms_p50": ms(percentile(tally.itl, 0.5)), "itl_ms_p99": ms(percentile(tally.itl, 0.99)),
        "output_tokens_per_s": round(tally.tokens / elapsed, 1),
        "server_rss_mb_start": round(rss_start, 1), "server_rss_mb_end": round(rss_mb(pids), 1),
        "rss_mb_by_rank_over_time": series,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rss-every-s", type=float, default=30.0, help="per-rank RSS sampling period")
    parser.add_argument("--json", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if urlparse(args.url).hostname not in LOOPBACK:
        parser.error("the soak test only targets a server on this machine (loopback)")
    report = asyncio.run(soak(args))
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["requests_completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
