"""Streaming ``/generate`` clients and the served figures measured with them.

Each figure is an async function of (client, url, FigureConfig, rng) that returns named
values; bench_served prefixes them with the server (``tp1/``, ``tp2/``). Prompts are random
token ids from the normal range of the vocabulary, fresh per request (so nothing is reused
unless a figure repeats a prompt on purpose), and every request is greedy with ``ignore_eos``
so it generates exactly ``max_new_tokens``.

The client shares the machine with the server (llama.cpp's tools have no client to pay for),
so it is kept lean: aiohttp's C-parsed responses and orjson for each event. Measured on the
2-vCPU Zen 3 against a TP=1 server streaming 1024 tokens: ~0.36 ms of client CPU per token,
where httpx's ``aiter_lines`` with ``json.loads`` took ~0.96 ms, CPU time the server's two
engine threads lost (batch-1 decode, 16 alternating rounds: 1.04x with the lean client).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp
import orjson

from launch.served_stats import (
    Trace,
    decode_rate,
    itl,
    longest_gap,
    median,
    output_rate,
    percentile,
    steady_decode_rate,
)

FIRST_NORMAL_ID = 259  # after <unk>, <s>, </s> and the 256 byte tokens (launch.gguf_export)


@dataclass(frozen=True)
class FigureConfig:
    tokens: int = 128  # new tokens per request in the decode figures
    prompt: int = 128  # prompt tokens in the concurrency figures
    depths: tuple[int, ...] = (128, 1024, 4096, 8192, 16384)
    prefill: int = 8192
    prefix: int = 2048
    gap_prompt: int = 4096
    gap_stream_budget: int = 8192  # outlasts the admission while decode < 2x prefill tok/s
    vocab: int = 32000


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_NORMAL_ID, vocab) for _ in range(n)]


def new_session(connections: int = 512) -> aiohttp.ClientSession:
    """One pooled session for a benchmark run (up to ``connections`` streams at once)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=3600.0))


async def stream(client: aiohttp.ClientSession, url: str, ids: list[int], new_tokens: int,
                 stop: asyncio.Event | None = None, seen: list | None = None) -> Trace:
    """One streamed greedy request; with ``stop``, the stream is closed (the server aborts the
    request) at the first event after it is set. ``seen`` receives events as they arrive."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    events: list[tuple[float, int]] = [] if seen is None else seen
    sent = time.perf_counter()
    async with client.post(url + "/generate", data=orjson.dumps(body),
                           headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate: {resp.status} {(await resp.read())[:500]!r}")
        pending = b""
        # Events end with a blank line; whatever arrived is split at once (an event that a
        # read cut in two waits in ``pending``), and an event's time is its arrival's.
        async for chunk in resp.content.iter_any():
            pending += chunk
            *done, pending = pending.split(b"\n\n")
            now = time.perf_counter()
            for event in done:
                if event.startswith(b"data: {"):  # not "data: [DONE]"
                    meta = orjson.loads(event[6:])["meta_info"]
                    events.append((now, int(meta["completion_tokens"])))
            if stop is not None and stop.is_set() and done:
                break
    return Trace(sent, tuple(events), len(ids))


def _latency_figures(name: str, traces: list[Trace]) -> dict[str, float]:
    gaps = itl(traces)
    return {f"{name}.ttft_ms": 1e3 * median([t.ttft for t in traces]),
            f"{name}.itl_p50_ms": 1e3 * median(gaps),
            f"{name}.itl_p99_ms": 1e3 * percentile(gaps, 99)}


async def concurrency(client: aiohttp.ClientSession, url: str, cfg: FigureConfig,
                      rng: random.Random, clients: int) -> dict[str, float]:
    """``clients`` streams at once: aggregate decode tok/s, output tok/s, TTFT and ITL."""
    prompts = [random_ids(rng, cfg.prompt, cfg.vocab) for _ in range(clients)]
    traces = await asyncio.gather(*(stream(client, url, p, cfg.tokens) for p in prompts))
    name = f"b{clients}"
    return {f"{name}.decode_tok_s": steady_decode_rate(traces),
            f"{name}.output_tok_s": output_rate(traces), **_latency_figures(name, traces)}


async def context_depths(client: aiohttp.ClientSession, url: str, cfg: FigureConfig,
                         rng: random.Random) -> dict[str, float]:
    """Decode tok/s after a prompt of each depth (one stream at a time)."""
    out = {}
    for depth in cfg.depths:
        trace = await stream(client, url, random_ids(rng, depth, cfg.vocab), cfg.tokens)
        out[f"ctx{depth}.decode_tok_s"] = decode_rate(trace)
        out[f"ctx{depth}.ttft_s"] = trace.ttft
    return out


async def prefill(client: aiohttp.ClientSession, url: str, cfg: FigureConfig,
                  rng: random.Random) -> dict[str, float]:
    """Prompt tokens per second of TTFT for one long prompt."""
    trace = await stream(client, url, random_ids(rng, cfg.prefill, cfg.vocab), 1)
    return {f"prefill{cfg.prefill}.tok_s": cfg.prefill / trace.ttft,
            f"prefill{cfg.prefill}.ttft_s": trace.ttft}


async def prefix(client: aiohttp.ClientSession, url: str, cfg: FigureConfig,
                 rng: random.Random) -> dict[str, float]:
    """The same prompt twice: TTFT the second time over the first (prefix reuse)."""
    ids = random_ids(rng, cfg.prefix, cfg.vocab)
    first = await stream(client, url, ids, 1)
    second = await stream(client, url, ids, 1)
    name = f"prefix{cfg.prefix}"
    return {f"{name}.ttft_first_s": first.ttft, f"{name}.ttft_second_s": second.ttft,
            f"{name}.ratio": second.ttft / first.ttft}


async def midstream_gap(client: aiohttp.ClientSession, url: str, cfg: FigureConfig,
                        rng: random.Random) -> dict[str, float]:
    """A running stream's longest gap while a long prompt is admitted, over that prompt's TTFT
    alone. The stream is closed once the prompt has its first token; ``stream_outlived`` says
    whether it was still running then (else its budget was too small for this machine)."""
    n = cfg.gap_prompt
    alone = await stream(client, url, random_ids(rng, n, cfg.vocab), 1)
    stop, seen = asyncio.Event(), []
    runner = asyncio.create_task(stream(client, url, random_ids(rng, cfg.prompt, cfg.vocab),
                                        cfg.gap_stream_budget, stop, seen))
    while len(seen) < 8 and not runner.done():
        await asyncio.sleep(0.005)
    sent = time.perf_counter()
    long = await stream(client, url, random_ids(rng, n, cfg.vocab), 1)
    done = long.events[0][0]
    stop.set()
    trace = await runner
    gap = longest_gap(trace, sent, done)
    name = f"gap{n}"
    return {f"{name}.max_gap_s": gap, f"{name}.ttft_alone_s": alone.ttft,
            f"{name}.ttft_mixed_s": long.ttft, f"{name}.ratio": gap / alone.ttft,
            f"{name}.stream_outlived": float(trace.events[-1][0] >= done)}
