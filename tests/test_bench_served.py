"""The served benchmark's pure parts: llama.cpp output parsing, statistics, the ratio table.

Tool outputs below are trimmed copies of what llama.cpp (as vendored by llama-cpp-python
0.3.36) printed for launch/bench_model's GGUF; statistics are checked against numpy and
hand-computed values. No network, no llama.cpp, no server.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from launch import served_client as sc
from launch.llamacpp_output import (
    BatchedRow,
    BenchTest,
    parse_batched_bench,
    parse_llama_bench,
    parse_simple_tokens,
)
from launch.machine import parse_cpuinfo
from launch.served_llama import best_of_threads, llama_figures
from launch.served_report import Row, summarise, table, with_slope
from launch.served_rows import parse_figures, rows
from launch.served_stats import (
    Trace,
    decode_rate,
    itl,
    longest_gap,
    output_rate,
    paired_ratio,
    percentile,
    steady_decode_rate,
)

T = TypeVar("T")

BENCH_JSON = """[
  {
    "build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
    "model_type": "llama ?B BF16", "n_batch": 2048, "n_ubatch": 512, "n_threads": 2,
    "n_prompt": 0, "n_gen": 8, "n_depth": 0, "test_time": "2026-12-01T04:15:13Z",
    "avg_ns": 2292012004, "stddev_ns": 0, "avg_ts": 3.490383, "stddev_ts": 0.000000,
    "samples_ns": [ 2292012004 ],
    "samples_ts": [ 3.49038 ]
  },
  {
    "build_commit": "unknown", "build_number": 0, "n_threads": 2,
    "n_prompt": 0, "n_gen": 8, "n_depth": 128, "avg_ts": 2.5, "stddev_ts": 0.1,
    "samples_ns": [ 3200000000, 3200000000 ],
    "samples_ts": [ 2.4, 2.6 ]
  }
]
"""

BENCH_MD = """| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| llama ?B BF16                  | 107.53 MiB |    56.37 M | CPU        |       2 |            pp64 |        68.47 ± 23.69 |
| llama ?B BF16                  | 107.53 MiB |    56.37 M | CPU        |       2 |             tg8 |          6.73 ± 1.75 |
| llama ?B BF16                  | 107.53 MiB |    56.37 M | CPU        |       2 |      pp64 @ d64 |         48.96 ± 9.19 |
| llama ?B BF16                  | 107.53 MiB |    56.37 M | CPU        |       2 |       tg8 @ d64 |          1.69 ± 0.54 |
| llama ?B BF16                  | 107.53 MiB |    56.37 M | CPU        |       2 |      pp64+tg8 |         30.00 ± 1.00 |

build: unknown (0)
"""

BATCHED_MD = """llama_context: n_ctx = 2048
main: n_kv_max = 2048, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_threads = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |      8 |    2 |     80 |    1.406 |    45.52 |    6.182 |     2.59 |    7.588 |    10.54 |
|    32 |      8 |    4 |    160 |    3.652 |    35.05 |   14.200 |     2.25 |   17.852 |     8.96 |

llama_perf_context_print:        load time =     123.45 ms
"""

BATCHED_JSONL = (
    '{"n_kv_max": 2048, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 64, "pl": 16, '
    '"n_kv": 3072, "t_pp": 1.5, "speed_pp": 1365.3, "t_tg": 1.4, "speed_tg": 731.4, '
    '"t": 2.9, "speed": 1059.3}\n')


def test_llama_bench_json() -> None:
    tests = parse_llama_bench(BENCH_JSON)
    assert [(t.n_prompt, t.n_gen, t.n_depth) for t in tests] == [(0, 8, 0), (0, 8, 128)]
    assert tests[0].avg_ts == pytest.approx(3.490383)
    assert tests[1].samples_ts == (2.4, 2.6) and tests[1].n_threads == 2
    assert [t.name for t in tests] == ["tg8", "tg8 @ d128"]


def test_llama_bench_jsonl_equals_json() -> None:
    jsonl = "\n".join(json.dumps(d) for d in json.loads(BENCH_JSON))
    assert parse_llama_bench(jsonl) == parse_llama_bench(BENCH_JSON)


def test_llama_bench_markdown() -> None:
    tests = parse_llama_bench(BENCH_MD)
    assert [t.name for t in tests] == ["pp64", "tg8", "pp64 @ d64", "tg8 @ d64", "pp64+tg8"]
    assert [t.avg_ts for t in tests] == [68.47, 6.73, 48.96, 1.69, 30.0]
    assert tests[3].n_depth == 64 and tests[3].n_gen == 8 and tests[3].n_threads == 2


def test_batched_bench_markdown_skips_log_lines() -> None:
    got = parse_batched_bench(BATCHED_MD)
    assert [(r.pp, r.tg, r.b) for r in got] == [(32, 8, 2), (32, 8, 4)]
    assert [r.s_tg for r in got] == [2.59, 2.25] and got[1].s_pp == 35.05


def test_batched_bench_jsonl() -> None:
    (row,) = parse_batched_bench("log line\n" + BATCHED_JSONL)
    assert (row.pp, row.tg, row.b, row.s_tg, row.s_pp) == (128, 64, 16, 731.4, 1365.3)


def test_batched_bench_without_table_is_empty() -> None:
    assert parse_batched_bench("error: unable to load model\n") == []


def test_simple_tokens() -> None:
    vocab = ["<unk>", "<s>", "</s>", "<0x00>", "a", "b", "c"]
    assert parse_simple_tokens("<s>abcba\n", "ab", vocab) == [6, 5, 4]
    assert parse_simple_tokens("<s>ab" + "c\x00b", "ab", vocab) == [6, -1]  # a byte token
    with pytest.raises(ValueError):
        parse_simple_tokens("<s>xy", "ab", vocab)


def trace(sent: float, times: list[float], counts: list[int] | None = None) -> Trace:
    counts = counts or list(range(1, len(times) + 1))
    return Trace(sent, tuple(zip(times, counts)), 10)


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.random(n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))


def test_decode_rate_and_itl() -> None:
    t = trace(0.0, [0.5, 0.6, 0.8, 1.1], [1, 2, 4, 5])  # one event carried two tokens
    assert t.ttft == 0.5 and t.tokens == 5
    assert decode_rate(t) == pytest.approx(4 / 0.6)
    assert itl([t]) == pytest.approx([0.1, 0.1, 0.1, 0.3])


def test_steady_rate_counts_only_the_overlap() -> None:
    # stream A decodes from t=1 to t=5 (1 tok per 0.5 s), stream B from t=2 to t=4 (1 per 0.25 s)
    a = trace(0.0, [1 + 0.5 * i for i in range(9)])
    b = trace(0.0, [2 + 0.25 * i for i in range(9)])
    # window (2, 4]: A delivers 4 tokens (2.5, 3, 3.5, 4), B 8: 12 tokens in 2 s
    assert steady_decode_rate([a, b]) == pytest.approx(6.0)
    assert steady_decode_rate([a]) == pytest.approx(decode_rate(a))
    assert output_rate([a, b]) == pytest.approx(18 / 5)


def test_steady_rate_without_overlap_uses_all_decode() -> None:
    a, b = trace(0.0, [1, 2, 3]), trace(0.0, [4, 5, 6])
    assert steady_decode_rate([a, b]) == pytest.approx(4 / 5)


def test_longest_gap_overlapping_an_interval() -> None:
    t = trace(0.0, [1.0, 1.1, 3.0, 3.1, 6.0])
    assert longest_gap(t, 1.05, 3.05) == pytest.approx(1.9)
    assert longest_gap(t, 3.2, 3.3) == pytest.approx(2.9)  # the gap spanning the interval
    assert math.isnan(longest_gap(t, 7.0, 8.0))


def test_paired_ratio_is_median_of_rounds() -> None:
    assert paired_ratio([10, 20, 30], [10, 10, 10]) == 2.0
    assert paired_ratio([10, None, 30], [5, 10, None]) == 2.0
    assert math.isnan(paired_ratio([None], [1.0]))
    assert paired_ratio([-3.0, 4.0], [2.0, 2.0]) == 2.0  # a negative fitted cost is noise


def test_best_of_threads() -> None:
    got = best_of_threads({1: {"b1.decode_tok_s": 68.0, "b16.decode_tok_s": 100.0},
                           2: {"b1.decode_tok_s": 4.2, "b16.decode_tok_s": 300.0}})
    assert got["b1.decode_tok_s"] == 68.0 and got["b1.decode_tok_s.threads"] == 1
    assert got["b16.decode_tok_s"] == 300.0 and got["b16.decode_tok_s.threads"] == 2
    assert got["b1.decode_tok_s@t2"] == 4.2


class FakeLlama:
    """Answers like llama-bench / llama-batched-bench would for the flags it is given."""

    threads = 2

    def bench(self, *flags: str) -> list[BenchTest]:
        f = dict(zip(flags[::2], flags[1::2]))
        depths = [int(d) for d in f.get("-d", "0").split(",")]
        return [BenchTest(int(f["-p"]), int(f["-n"]), d, 100.0 / (1 + d / 1024)) for d in depths]

    def batched(self, prompt: int, gen: int, parallel: list[int]) -> list[BatchedRow]:
        return [BatchedRow(prompt, gen, b, 500.0, 40.0 * b, 400.0) for b in parallel]


def test_llama_figures_produce_every_key_the_rows_compare() -> None:
    cfg = sc.FigureConfig()
    figures = ("b1", "b16", "b64", "ctx", "prefill", "prefix", "gap")
    got = llama_figures(FakeLlama(), figures, cfg)  # type: ignore[arg-type]
    with_slope(got, cfg.depths)
    needed = {r.theirs[1] for r in rows(figures, (1, 2), (1,), cfg)
              if r.theirs is not None and r.theirs[0] == "llama.cpp"}
    assert needed <= set(got), needed - set(got)
    assert got["b16.decode_tok_s"] == 640.0 and got["ctx1024.decode_tok_s"] == 50.0
    assert got["ctx.ms_per_1k"] == pytest.approx(10.0)  # 1/rate grows 10 ms per 1K exactly


def test_slope_matches_polyfit() -> None:
    depths = [128, 1024, 4096, 8192]
    rates = [70.0, 35.0, 12.5, 5.8]
    values = {f"tp1/ctx{d}.decode_tok_s": r for d, r in zip(depths, rates)}
    with_slope(values, depths, prefix="tp1/")
    want = np.polyfit(np.array(depths) / 1024, 1e3 / np.array(rates), 1)[0]
    assert values["tp1/ctx.ms_per_1k"] == pytest.approx(want)


def test_summary_ratios_targets_and_blanks() -> None:
    rounds = {"tpserve": [{"x": 50.0, "cost": 10.0, "r": 0.9}, {"x": 60.0, "cost": 20.0, "r": 0.1}],
              "llama.cpp": [{"x": 100.0, "cost": 5.0}, {"x": 100.0, "cost": 5.0}]}
    rate = summarise(Row("rate", ("x",), "tok/s", ("llama.cpp", "x"), goal=(">=", 0.8)), rounds)
    assert (rate.ours, rate.theirs, rate.ratio, rate.met) == ((55.0,), 100.0, 0.55, False)
    cost = summarise(Row("cost", ("cost",), "ms", ("llama.cpp", "cost"), lower_is_better=True),
                     rounds)
    assert cost.ratio == pytest.approx(0.375)  # median of 5/10 and 5/20
    inner = summarise(Row("prefix", ("x",), "s", ratio_key="r", goal=("<=", 0.3)), rounds)
    assert inner.ratio == pytest.approx(0.5) and inner.met is False
    alone = summarise(Row("rate", ("x",), "tok/s", ("llama.cpp", "x")), {"tpserve": rounds["tpserve"]})
    assert alone.theirs is None and alone.ratio is None
    own = summarise(Row("tp", ("x", "cost"), "", ("tpserve", "cost")), rounds)
    assert own.ratio == pytest.approx(4.0)  # median of 50/10 and 60/20
    text = table([rate, alone, own])
    assert "| rate | 55.0 tok/s | 100.0 tok/s | 0.55x | >= 0.8x: not met |" in text
    assert "| rate | 55.0 tok/s |  |  |  |" in text
    assert "| tp | 55.0 / 15.0 |  | 4.00x |  |" in text  # a tpserve baseline is not llama.cpp's


def test_parse_figures() -> None:
    assert parse_figures("b1, ctx") == ("b1", "ctx")
    with pytest.raises(ValueError):
        parse_figures("b1,b32")


def test_cpuinfo() -> None:
    text = ("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2 fma avx512f "
            "avx512_bf16 amx_tile\n\nprocessor\t: 1\nmodel name\t: other\nflags\t: sse\n")
    info = parse_cpuinfo(text)
    assert info["model"] == "AMD EPYC 7B13"
    assert info["flags"] == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]


def fake_app(chunk: int = 1) -> web.Application:
    """/generate streaming ``max_new_tokens`` events of ``chunk`` tokens, like tpserve's SSE:
    each event carries the whole output so far (so long streams have long events)."""

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = body["sampling_params"]["max_new_tokens"]
        assert body["stream"] and body["sampling_params"]["ignore_eos"]
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(chunk, n + chunk, chunk):
            event = {"text": "x" * k, "output_ids": [5] * k, "meta_info": {"completion_tokens": k}}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


async def _with_fake_server(chunk: int, work: Callable[[aiohttp.ClientSession, str], Awaitable[T]]
                            ) -> T:
    """Run ``work(session, url)`` against ``fake_app`` on a loopback port."""
    server = TestServer(fake_app(chunk), host="127.0.0.1")
    await server.start_server()
    try:
        async with sc.new_session() as session:
            return await work(session, str(server.make_url("")).rstrip("/"))
    finally:
        await server.close()


def test_figures_produce_every_key_the_rows_report() -> None:
    cfg = sc.FigureConfig(tokens=8, prompt=4, depths=(16, 32), prefill=64, prefix=32,
                          gap_prompt=32, gap_stream_budget=64)

    async def measure(client: aiohttp.ClientSession, url: str) -> dict[str, float]:
        rng, out = random.Random(0), {}
        for clients in (1, 16, 64):
            out |= await sc.concurrency(client, url, cfg, rng, clients)
        for fig in (sc.context_depths, sc.prefill, sc.prefix, sc.midstream_gap):
            out |= await fig(client, url, cfg, rng)
        return out

    got = {f"tp1/{k}": v for k, v in asyncio.run(_with_fake_server(1, measure)).items()}
    with_slope(got, cfg.depths, prefix="tp1/")
    needed = {k for r in rows(("b1", "b16", "b64", "ctx", "prefill", "prefix", "gap"), (1,), (1,), cfg)
              for k in (*r.ours, *([r.ratio_key] if r.ratio_key else []))}
    assert needed <= set(got), needed - set(got)
    assert got["tp1/b16.output_tok_s"] > 0 and got["tp1/gap32.stream_outlived"] in (0.0, 1.0)


def test_stream_reads_multi_token_events() -> None:
    async def one(client: aiohttp.ClientSession, url: str) -> Trace:
        return await sc.stream(client, url, [300, 301], 9)

    t = asyncio.run(_with_fake_server(3, one))
    assert [c for _, c in t.events] == [3, 6, 9] and t.prompt_tokens == 2


def test_stream_reads_events_longer_than_a_line_buffer() -> None:
    """20,000 tokens: the last events are ~200 KB, past aiohttp's line-reading limit."""
    async def one(client: aiohttp.ClientSession, url: str) -> Trace:
        return await sc.stream(client, url, [300], 40_000)

    t = asyncio.run(_with_fake_server(2000, one))
    assert [c for _, c in t.events] == list(range(2000, 40_001, 2000))


def test_tokenizer_matches_gguf_vocabulary() -> None:
    from tokenizers import Tokenizer

    from launch.bench_model import tokenizer_json
    from launch.gguf_export import vocabulary

    vocab = vocabulary(32000)
    assert len(set(vocab)) == 32000 and all(len(t) == 1 for t in vocab[259:])
    tok = Tokenizer.from_str(json.dumps(tokenizer_json(32000)))
    ids = [259, 300, 20000, 31999]
    assert tok.encode("".join(vocab[i] for i in ids)).ids == ids
    assert tok.get_vocab_size() == 32000


def test_thread_wins_per_figure_and_round() -> None:
    from launch.served_writer import thread_wins

    rounds = [best_of_threads({1: {"b1.decode_tok_s": 9.0}, 2: {"b1.decode_tok_s": 5.0}}),
              best_of_threads({1: {"b1.decode_tok_s": 4.0}, 2: {"b1.decode_tok_s": 5.0}})]
    assert thread_wins(rounds) == "b1 1,2"
