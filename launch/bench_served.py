"""Served performance against llama.cpp on the same CPU, the same weights, in one run.

``python -m launch.bench_served [--rounds 3] [--figures b1,b16,ctx,...] [--out DIR]``

Builds (or reuses) issue 15's benchmark model (``launch.bench_model``: a random Llama, hidden
512 x 8 layers, bf16, 80 MB read per token) as a checkpoint and a GGUF. Each round starts
every tpserve server the way a user would (TP=1 ``python -m tpserve --model DIR``, TP=2
``torchrun --nproc-per-node 2 -m tpserve --model DIR --allreduce shm``), measures the figures
with streaming ``/generate`` clients, stops it, then runs llama.cpp's native ``llama-bench``
and ``llama-batched-bench`` on the GGUF (when built: ``launch/build_llamacpp.sh``) at 1 thread
and at one per usable CPU, each figure counting llama.cpp's better one (``launch.served_llama``).
Which engine goes first alternates round by round; the report gives medians over rounds and
the median of per-round ratios, against issue 15's targets.

Writes ``DIR/results.json`` (every round's values, the rows, the machine), ``DIR/results.md``
(the table) and ``DIR/results.png`` (ratios against targets); server logs go to DIR too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from launch import served_client as sc
from launch import served_llama
from launch.bench_model import BenchModel, build, weight_bytes_per_token
from launch.llamacpp_tools import LlamaCpp, find_bin_dir
from launch.machine import describe, machine_info
from launch.served_agreement import check
from launch.served_report import Rounds, summarise, table, with_slope
from launch.served_rows import FIGURES, parse_figures, rows
from launch.served_servers import served
from launch.served_writer import plain, write_results

LONG_FIGURES = {"ctx": sc.context_depths, "prefill": sc.prefill, "prefix": sc.prefix,
                "gap": sc.midstream_gap}


@dataclass(frozen=True)
class Plan:
    model: BenchModel
    figures: tuple[str, ...]
    tps: tuple[int, ...]
    long_tps: tuple[int, ...]
    cfg: sc.FigureConfig
    server_args: tuple[str, ...]
    llama: LlamaCpp | None
    llama_threads: tuple[int, ...]
    out: Path
    seed: int


async def _tpserve_figures(url: str, plan: Plan, rng: random.Random, long: bool
                           ) -> dict[str, float]:
    async with sc.new_session() as client:
        await sc.stream(client, url, sc.random_ids(rng, 16, plan.cfg.vocab), 4)  # first contact
        values: dict[str, float] = {}
        for fig in plan.figures:
            try:
                if fig.startswith("b"):
                    values |= await sc.concurrency(client, url, plan.cfg, rng, int(fig[1:]))
                elif long:
                    values |= await LONG_FIGURES[fig](client, url, plan.cfg, rng)
            # the note says which figure broke, and how
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise FigureFailed(f"figure {fig}: {type(exc).__name__}: {exc!r}") from exc
    return values


class FigureFailed(RuntimeError):
    """A figure's client saw a transport error (the round's other servers still run)."""


def tpserve_round(plan: Plan, index: int, notes: list[str]) -> dict[str, float]:
    values: dict[str, float] = {}
    for tp in plan.tps:
        rng = random.Random(plan.seed * 1_000_003 + index * 1009 + tp)
        try:
            with served(plan.model.checkpoint, tp, list(plan.server_args),
                        plan.out / f"server-tp{tp}.log") as url:
                got = asyncio.run(_tpserve_figures(url, plan, rng, tp in plan.long_tps))
        except Exception as exc:  # keep the other servers' and rounds' numbers
            notes.append(f"round {index}, TP={tp}: {type(exc).__name__}: {exc}"[:2000])
            continue
        values |= {f"tp{tp}/{k}": v for k, v in got.items()}
        with_slope(values, plan.cfg.depths, prefix=f"tp{tp}/")
    return values


def llama_round(plan: Plan, notes: list[str]) -> dict[str, float]:
    assert plan.llama is not None
    values: dict[str, float] = {}
    try:
        values = served_llama.llama_round(plan.llama, plan.llama_threads, plan.figures, plan.cfg)
    except Exception as exc:  # report it, keep the tpserve numbers
        notes.append(f"llama.cpp: {type(exc).__name__}: {exc}"[:2000])
    with_slope(values, plan.cfg.depths)
    return values


def agreement(plan: Plan) -> dict[str, object] | str:
    """Greedy tokens of both engines on the same prompts (TP=1 server)."""
    if plan.llama is None:
        return "skipped: llama.cpp not available"
    try:
        with served(plan.model.checkpoint, 1, list(plan.server_args),
                    plan.out / "server-agreement.log") as url:
            return check(url, plan.llama, plan.cfg.vocab)
    except Exception as exc:
        return f"failed: {type(exc).__name__}: {exc}"[:2000]


def run(plan: Plan, rounds: int, check_agreement: bool) -> dict[str, object]:
    results: Rounds = {"tpserve": [], "llama.cpp": []}
    notes: list[str] = []
    load: list[dict[str, object]] = []  # neighbours' load: the noise a reader must weigh
    agree = agreement(plan) if check_agreement else "skipped: --no-agreement"
    for index in range(rounds):
        order = ["tpserve", "llama.cpp"] if index % 2 == 0 else ["llama.cpp", "tpserve"]
        for engine in order:
            if engine == "llama.cpp" and plan.llama is None:
                continue
            start, before = time.perf_counter(), os.getloadavg()[0]
            if engine == "tpserve":
                results["tpserve"].append(tpserve_round(plan, index, notes))
            else:
                results["llama.cpp"].append(llama_round(plan, notes))
            seconds = time.perf_counter() - start
            load.append({"round": index, "engine": engine, "seconds": seconds,
                         "loadavg_1m": [before, os.getloadavg()[0]]})
            print(f"round {index + 1}/{rounds}: {engine} {seconds:.0f}s, 1-min load average "
                  f"{before:.1f} -> {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            # a long run interrupted still leaves every finished part
            partial = plain({"rounds": results, "load": load})
            (plan.out / "rounds.json").write_text(json.dumps(partial))
    summaries = [summarise(r, results) for r in rows(plan.figures, plan.tps, plan.long_tps,
                                                     plan.cfg)]
    return {"rounds": results, "summaries": summaries, "notes": notes, "agreement": agree,
            "load": load}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch.bench_served", description=__doc__.split("\n")[0])
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--figures", default=",".join(FIGURES), help=f"subset of {','.join(FIGURES)}")
    ap.add_argument("--tp", type=ints, default=(1, 2), help="servers, e.g. 1,2")
    ap.add_argument("--long-tp", type=ints, default=(1,),
                    help="servers that also run ctx, prefill, prefix and gap")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per decode request")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens, concurrency figures")
    ap.add_argument("--depths", type=ints, default=sc.FigureConfig.depths)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--gap-prompt", type=int, default=4096)
    ap.add_argument("--server-args", default="", help="extra tpserve flags, one string")
    ap.add_argument("--model", type=Path, help="benchmark checkpoint dir (built if missing)")
    ap.add_argument("--llamacpp-bin", type=Path, help="dir with llama-bench etc.")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--llama-threads", type=ints,
                    default=tuple(sorted({1, int(machine_info()["cpus"])})),  # type: ignore[call-overload]
                    help="llama.cpp thread counts; each figure counts the best")
    ap.add_argument("--no-agreement", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_out/served"))
    return ap.parse_args(argv)


def make_plan(args: argparse.Namespace, notes: list[str]) -> Plan:
    from launch.llamacpp_tools import cache_dir

    model = build(args.model or cache_dir().parent / "bench" / "llama-512x8")
    cfg = replace(sc.FigureConfig(), tokens=args.tokens, prompt=args.prompt, depths=args.depths,
                  prefill=args.prefill, prefix=args.prefix, gap_prompt=args.gap_prompt,
                  vocab=json.loads((model.checkpoint / "config.json").read_text())["vocab_size"])
    llama = None
    if args.skip_llamacpp:
        notes.append("llama.cpp skipped (--skip-llamacpp): no ratios to it")
    else:
        bin_dir, why = find_bin_dir(args.llamacpp_bin)
        if bin_dir is None:
            notes.append(f"llama.cpp skipped: {why}; no ratios to it")
        else:
            llama = LlamaCpp(bin_dir, model.gguf, max(args.llama_threads))
    args.out.mkdir(parents=True, exist_ok=True)
    return Plan(model, parse_figures(args.figures), args.tp, args.long_tp, cfg,
                tuple(shlex.split(args.server_args)), llama, args.llama_threads, args.out,
                args.seed)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    notes: list[str] = []
    plan = make_plan(args, notes)
    machine = machine_info()
    res = run(plan, args.rounds, not args.no_agreement)
    res["notes"] = notes + res["notes"]  # type: ignore[operator]
    res |= {"machine": machine, "command": ["python", "-m", "launch.bench_served",
                                            *(sys.argv[1:] if argv is None else argv)],
            "model": {"checkpoint": str(plan.model.checkpoint), "gguf": str(plan.model.gguf),
                      "mb_per_token": weight_bytes_per_token(plan.model.checkpoint) / 1e6},
            "llama.cpp": {"bin": str(plan.llama.bin_dir), "threads": plan.llama_threads}
            if plan.llama else None, "config": vars(plan.cfg)}
    print(table(res["summaries"]))  # type: ignore[arg-type]
    print(f"\nmachine: {describe(machine)}")
    agree = res["agreement"]
    print(f"agreement: {agree if isinstance(agree, str) else agree['summary']}")  # type: ignore[index]
    for line in res["notes"]:  # type: ignore[attr-defined]
        print(f"note: {line}")
    write_results(res, plan.out)
    return res


if __name__ == "__main__":
    main()
