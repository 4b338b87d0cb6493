"""Normal clients' latency with and without a hostile client on the same server.

    python -m launch.bench_hostile --url http://127.0.0.1:30000 --normal 4 --seconds 20 --rounds 2
    python -m launch.bench_hostile --launch "python -m tpserve --device cpu --port 30000"

Alternates quiet windows (the measured normal streaming clients plus one more, well-behaved
client) and hostile windows (the same measured clients plus one hostile client going through
the abuses below one after another), ``--rounds`` times each, so slow drift on a shared
machine hits both alike. The report: TTFT and inter-token latency
p50/p99 of the normal clients in each kind of window, the hostile/quiet ratio (target: p99
within 1.5x), what the hostile client got back, and a JSON file.

The hostile client: 64 stop strings of 256 characters per request (the limit) and 10,000
(refused); bodies just under and over ``--max-request-bytes``; prompt text far beyond the
context; 100,000 one-token prompts in one body; JSON nested 200,000 deep; huge numbers;
streams read two events a second, then abandoned; requests dropped mid-generation
(streaming and not); rid squatting and aborts of labels it does not own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from launch.ab import start_server
from launch.soak import Tally, client_loop, percentile

TARGET_RATIO = 1.5
Abuse = Callable[[httpx.AsyncClient, random.Random], Awaitable[str]]


async def huge_stops(client: httpx.AsyncClient, rng: random.Random) -> str:
    stops = ["".join(rng.choice("xyzw") for _ in range(256)) for _ in range(64)]
    body = {"text": "import ", "stream": True,
            "sampling_params": {"max_new_tokens": 64, "stop": stops, "ignore_eos": True}}
    async with client.stream("POST", "/generate", json=body) as r:
        async for _ in r.aiter_lines():
            pass
    refused = await client.post("/generate", json={"text": "a", "sampling_params": {
        "stop": ["ab"] * 10_000}})
    return f"64x256 stops {r.status_code}, 10k stops {refused.status_code}"


async def huge_bodies(client: httpx.AsyncClient, rng: random.Random, cap: int) -> str:
    under = await client.post("/generate", content=b'{"text": "' + b"a b " * ((cap - 64) // 4)
                              + b'"}')
    over = await client.post("/generate", content=b'{"text": "' + b"x" * cap + b'"}')
    far = await client.post("/v1/completions", json={"prompt": "word " * 200_000})
    return f"under cap {under.status_code}, over cap {over.status_code}, long text {far.status_code}"


async def many_items(client: httpx.AsyncClient, rng: random.Random) -> str:
    items = await client.post("/generate", content=b'{"input_ids": ['
                              + b",".join([b"[1]"] * 100_000) + b"]}")
    deep = await client.post("/generate", content=b'{"text": ' + b"[" * 200_000
                             + b"]" * 200_000 + b"}")
    numbers = await client.post("/generate", content=b'{"text": "a", "sampling_params": '
                                b'{"top_k": 1' + b"0" * 400 + b', "temperature": 1e999}}')
    return f"100k prompts {items.status_code}, deep {deep.status_code}, huge numbers {numbers.status_code}"


async def slow_reader(client: httpx.AsyncClient, rng: random.Random) -> str:
    body = {"prompt": "def ", "max_tokens": 128, "stream": True, "ignore_eos": True}
    read = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            await asyncio.sleep(0.5)  # the server must not hold others back for this reader
            read += 1
            if read == 4:
                break  # and then leave without reading the rest
    return f"slow stream {r.status_code}"


async def drop_midway(client: httpx.AsyncClient, rng: random.Random) -> str:
    body: dict[str, Any] = {"text": "class ", "sampling_params": {"max_new_tokens": 512,
                                                                  "ignore_eos": True}}
    if rng.random() < 0.5:
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            async for _ in r.aiter_lines():
                break
        return "dropped a stream"
    try:
        await client.post("/generate", json=body, timeout=0.3)
    except httpx.TimeoutException:
        return "dropped a non-streaming request"
    return "finished before the drop"


async def squat_labels(client: httpx.AsyncClient, rng: random.Random) -> str:
    label = f"victim-{rng.randrange(4)}"
    aborted = await client.post("/abort_request", json={"rid": label})
    dup = await client.post("/generate", json={"text": "a", "rid": "hostile-fixed",
                                               "sampling_params": {"max_new_tokens": 4}})
    return f"abort {aborted.json().get('success')}, own rid {dup.status_code}"


def abuses(cap: int) -> dict[str, Abuse]:
    return {"stops": huge_stops, "bodies": lambda c, r: huge_bodies(c, r, cap),
            "items": many_items, "slow": slow_reader, "drops": drop_midway,
            "labels": squat_labels}


async def hostile_client(url: str, headers: dict[str, str], deadline: float, cap: int,
                         names: list[str]) -> Counter[str]:
    """One client, one abuse after another: the same share of the server as one normal
    client would take, spent on nothing but abuse."""
    outcomes: Counter[str] = Counter()
    table, rng = abuses(cap), random.Random(0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        for index in range(1 << 30):
            if time.monotonic() >= deadline:
                break
            try:
                outcomes[await table[names[index % len(names)]](client, rng)] += 1
            except httpx.HTTPError as exc:
                outcomes[f"client error {type(exc).__name__}"] += 1
    return outcomes


def hostile_process(url: str, headers: dict[str, str], seconds: float, cap: int,
                    names: list[str], out: Any) -> None:
    """Its own process: the hostile client's CPU time (building megabyte bodies) must not
    delay the normal clients' event loop, which would show up as their latency."""
    deadline = time.monotonic() + seconds
    out.put(dict(asyncio.run(hostile_client(url, headers, deadline, cap, names))))


async def window(args: argparse.Namespace, index: int, hostile: bool, tally: Tally,
                 outcomes: Counter[str]) -> None:
    """The measured normal clients plus one more client: well-behaved in a quiet window (its
    latencies are not counted), the hostile one in a hostile window. Both windows then carry
    the same number of clients, and the difference is the hostility alone."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    deadline = time.monotonic() + args.seconds
    jobs = [client_loop(args.url, headers, 1000 * index + i, deadline, args.max_tokens, tally)
            for i in range(args.normal)]
    proc, results = None, None
    if hostile:
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        proc = ctx.Process(target=hostile_process, args=(
            args.url, headers, args.seconds, args.max_request_bytes, args.abuses, results))
        proc.start()
    else:
        jobs.append(client_loop(args.url, headers, 1000 * index + 999, deadline,
                                  args.max_tokens, Tally()))
    await asyncio.gather(*jobs)
    if proc is not None and results is not None:
        outcomes.update(await asyncio.to_thread(results.get))
        proc.join()


def summary(tally: Tally) -> dict[str, Any]:
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {"requests": tally.completed, "errors": dict(tally.errors),
            "ttft_ms_p50": ms(percentile(tally.ttft, 0.5)), "ttft_ms_p99": ms(percentile(tally.ttft, 0.99)),
            "ttft_ms_max": ms(max(tally.ttft, default=None)),
            "itl_ms_p50": ms(percentile(tally.itl, 0.5)), "itl_ms_p99": ms(percentile(tally.itl, 0.99)),
            # A stall of the whole server is a handful of huge gaps: below the 99th percentile.
            "itl_ms_max": ms(max(tally.itl, default=None))}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    quiet, loud, outcomes = Tally(), Tally(), Counter[str]()
    for index in range(args.rounds):  # the same client seeds in both windows of a round
        await window(args, index, False, quiet, outcomes)
        await window(args, index, True, loud, outcomes)
    report: dict[str, Any] = {"quiet": summary(quiet), "hostile": summary(loud)}
    ratios = {key: round(report["hostile"][key] / report["quiet"][key], 2)
              for key in ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_max", "itl_ms_p50",
                          "itl_ms_p99", "itl_ms_max")
              if report["quiet"][key] and report["hostile"][key]}
    report["ratio_hostile_over_quiet"] = ratios
    report["p99_within_target"] = all(ratios.get(k, 0) <= TARGET_RATIO
                                      for k in ("ttft_ms_p99", "itl_ms_p99"))
    report["hostile_outcomes"] = dict(outcomes.most_common())
    report["settings"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    return report


def render(report: dict[str, Any]) -> str:
    keys = ("ttft_ms_p50", "ttft_ms_p99", "ttft_ms_max", "itl_ms_p50", "itl_ms_p99", "itl_ms_max")
    rows = ["| window | requests | TTFT p50 | TTFT p99 | TTFT max | ITL p50 | ITL p99 | ITL max "
            "| errors |", "|---|---|---|---|---|---|---|---|---|"]
    for name in ("quiet", "hostile"):
        s = report[name]
        cells = " | ".join(str(s[k]) for k in keys)
        rows.append(f"| {name} | {s['requests']} | {cells} | {s['errors'] or '-'} |")
    r = report["ratio_hostile_over_quiet"]
    rows.append("| hostile / quiet | | " + " | ".join(f"{r.get(k)}x" for k in keys) + " | |")
    verdict = "within" if report["p99_within_target"] else "NOT within"
    return "\n".join(rows) + f"\n\np99 latency {verdict} {TARGET_RATIO}x of the quiet run (ms)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launch.bench_hostile", description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--launch", help="command that starts the server (stopped afterwards)")
    ap.add_argument("--normal", type=int, default=4, help="normal streaming clients")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each window")
    ap.add_argument("--rounds", type=int, default=2, help="quiet + hostile window pairs")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-request-bytes", type=int, default=8 << 20, help="the server's cap")
    ap.add_argument("--abuses", default="stops,bodies,items,slow,drops,labels",
                    help="the abuses the hostile client cycles through")
    ap.add_argument("--api-key")
    ap.add_argument("--json", default="bench_hostile.json")
    args = ap.parse_args(argv)
    args.abuses = args.abuses.split(",")
    args.url = args.url.rstrip("/")
    proc = start_server(args.launch, args.url) if args.launch else None
    try:
        report = asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(render(report))
    print(json.dumps(report["hostile_outcomes"], indent=1))
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0 if report["p99_within_target"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
