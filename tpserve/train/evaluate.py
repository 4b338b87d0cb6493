"""Measure a target + EAGLE-3 draft pair with tpserve's own engine.

``accept_eval``: accept length per draft position on held-out prompts (used by the trainer).
``python -m tpserve.train.evaluate --target DIR --draft DIR`` times greedy batch-1 decoding
without speculation and with several draft settings, checks every speculative output equals
the plain greedy output, and prints a table (also written as JSON). Under ``torchrun`` it runs
tensor-parallel: rank 0 measures, the other ranks follow.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tpserve.args import ServerArgs
from tpserve.engine.sampling_params import SamplingParams
from tpserve.errors import exit_code_of
from tpserve.offline import OfflineEngine
from tpserve.train.corpus import heldout_files, read_text


@dataclass(frozen=True)
class SpecSetting:
    steps: int
    topk: int
    tokens: int

    @property
    def label(self) -> str:
        return f"steps {self.steps} / topk {self.topk} / {self.tokens} draft tokens"


DEFAULT_SETTINGS = (SpecSetting(1, 1, 2), SpecSetting(2, 1, 3), SpecSetting(3, 1, 4),
                    SpecSetting(4, 1, 5), SpecSetting(5, 1, 6), SpecSetting(6, 1, 7),
                    SpecSetting(4, 2, 8))


def eval_prompts(tok: Tokenizer, files: tuple[Path, ...], count: int, seed: int) -> list[list[int]]:
    """Held-out prompts: the first line of code after a random line break of a file."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for path in sorted(rng.sample(list(files), min(count, len(files)))):
        lines = [ln for ln in read_text(path).splitlines() if ln.strip()]
        start = rng.randrange(max(1, len(lines) - 3))
        out.append(tok.encode("\n".join(lines[start : start + 2]) + "\n",
                              add_special_tokens=False).ids[:48])
    return out


def engine_args(target: Path, draft: Path | None, setting: SpecSetting | None,
                device: str, **kw: object) -> ServerArgs:
    spec = {} if setting is None or draft is None else dict(
        speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
        speculative_num_steps=setting.steps, speculative_eagle_topk=setting.topk,
        speculative_num_draft_tokens=setting.tokens,
        speculative_adaptive="off")  # the setting measured, not the chooser's picks
    base = dict(device="cpu" if device == "auto" else device, max_total_tokens=8192,
                context_length=1024)
    return ServerArgs(model=str(target), **{**base, **kw}, **spec)  # type: ignore[arg-type]


def accept_eval(target: Path, draft: Path, prompts: list[list[int]], max_tokens: int,
                device: str = "auto", setting: SpecSetting = SpecSetting(3, 1, 4)) -> dict:
    """Greedy speculative decoding of ``prompts`` (together); accept statistics."""
    engine = OfflineEngine(engine_args(target, draft, setting, device))
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    spec = engine.spec.snapshot() if engine.spec is not None else {}
    engine.close()
    per_request = [o.meta.get("spec_accept_length", 0.0) for o in outs]
    return {"setting": setting.label, "prompts": len(prompts),
            "accept_length": spec.get("avg_accept_length"),
            "position_accept_rate": spec.get("position_accept_rate"),
            "mean_request_accept_length": sum(per_request) / max(1, len(per_request))}


def timed_run(engine: OfflineEngine, prompts: list[list[int]], max_tokens: int
              ) -> tuple[float, list[list[int]], list[float]]:
    """Batch 1: one prompt at a time; returns decode tok/s, outputs, accept lengths."""
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(max_new_tokens=4, temperature=0.0))  # warm-up
    tokens, seconds, outs, accept = 0, 0.0, [], []
    for p in prompts:
        start = time.perf_counter()
        out = engine.generate([p], params)[0]
        seconds += time.perf_counter() - start
        tokens += len(out.output_ids)
        outs.append(out.output_ids)
        accept.append(float(out.meta.get("spec_accept_length", 1.0)))
    return tokens / seconds, outs, accept


def bench(target: Path, draft: Path, prompts: list[list[int]], max_tokens: int,
          settings: tuple[SpecSetting, ...], **kw: object) -> list[dict] | None:
    """Rank 0 returns one row per setting; the plain baseline runs first and last, and
    speedups use the mean of the two, so load drift on a shared machine shows up in the
    table instead of silently favouring one side."""
    rank = int(os.environ.get("RANK", 0))
    rows: list[dict] = []
    reference: list[list[int]] = []
    for setting in (None, *settings, None):
        engine = OfflineEngine(engine_args(target, draft, setting, "cpu", **kw))
        if rank != 0:
            engine.follow()
            continue
        tok_s, outs, accept = timed_run(engine, prompts, max_tokens)
        engine.close()
        reference = reference or outs
        rows.append({"setting": setting.label if setting else "no speculation",
                     "tok_s": round(tok_s, 1),
                     "accept_length": round(sum(accept) / len(accept), 2),
                     "lossless": outs == reference})
    if rank != 0:
        return None
    rows[-1]["setting"] = "no speculation (again)"
    base = (rows[0]["tok_s"] + rows[-1]["tok_s"]) / 2
    for row in rows:
        row["speedup"] = round(row["tok_s"] / base, 2)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| setting | tok/s | speedup | accept length | output == greedy |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['tok_s']} | {r['speedup']}x | {r['accept_length']} | "
              f"{'yes' if r['lossless'] else 'NO'} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tpserve.train.evaluate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--allreduce", default="auto")
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args(argv)
    tok = Tokenizer.from_file(str(ns.target / "tokenizer.json"))
    prompts = eval_prompts(tok, heldout_files(ns.target, 0)[1], ns.prompts, seed=7)
    rows = bench(ns.target, ns.draft, prompts, ns.max_tokens, DEFAULT_SETTINGS,
                 dtype=ns.dtype, allreduce=ns.allreduce, cpu_threads=ns.cpu_threads)
    if rows is not None:
        print_table(rows)
        if ns.json:
            ns.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(exit_code_of(main))
