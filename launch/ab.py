"""A/B harness: sweep allreduce backends x speculative settings x concurrency on a live server.

``python -m launch.ab --server-url URL --backends gloo,shm --spec off,2/1/3,3/1/4
--concurrency 1 --out DIR`` switches the server live (``POST /admin/config``) through every
setting, benchmarks each (warm-up + repeated runs), and writes ``ab.json``, ``ab.png`` and a
table with tok/s, accept length, per-phase ms, allreduce ms per step and the speedup over
no speculation on the same backend, then a verdict and the cost model's predictions.
``--launch "CMD"`` starts the server itself (and stops it afterwards).

``adaptive`` in ``--spec`` is the engine's own choice per step (``--speculative-adaptive``):
e.g. ``--spec off,3/1/4,4/2/8,adaptive --concurrency 1,4,8,16``. Fixed arms pin the
settings (adaptive off); the adaptive arm hands them back to the chooser. At a concurrency C
above 1 a run is C closed-loop clients sending ``--requests-per-client`` requests each (as
``launch.spec_vs_plain``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from launch.ab_report import render_table, verdict, write_plot
from tpserve.bench import DEFAULT_PROMPTS, new_client, round_prompts, run_batch
from tpserve.spec.cost_model import Measurement, fit


@dataclass(frozen=True)
class Setting:
    backend: str
    # (num_steps, eagle_topk, num_draft_tokens), ADAPTIVE, or None (off)
    spec: tuple[int, int, int] | str | None
    concurrency: int

    @property
    def label(self) -> str:
        spec = ("off" if self.spec is None else self.spec if isinstance(self.spec, str)
                else "/".join(map(str, self.spec)))
        return f"{self.backend} spec={spec} c={self.concurrency}"


ADAPTIVE = "adaptive"


def parse_spec(text: str) -> tuple[int, int, int] | str | None:
    if text in ("off", "none", "0"):
        return None
    if text == ADAPTIVE:
        return ADAPTIVE
    steps, topk, tokens = (int(x) for x in text.split("/"))
    return steps, topk, tokens


def admin(url: str, body: dict[str, Any], key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/admin/config", json=body, headers=headers, timeout=120)
    if r.status_code != 200:
        raise SystemExit(f"error: /admin/config {body} -> {r.status_code}: {r.text}")
    return r.json()


def apply(url: str, s: Setting, key: str | None) -> None:
    spec: dict[str, Any] = {"enabled": s.spec is not None}
    if s.spec == ADAPTIVE:
        spec = {"adaptive": True}
    elif s.spec is not None:
        spec.update(num_steps=s.spec[0], eagle_topk=s.spec[1], num_draft_tokens=s.spec[2])
    admin(url, {"allreduce": s.backend, "speculative": spec, "profiling": True}, key)


def measure(url: str, s: Setting, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    apply(url, s, args.api_key)
    batch = round_prompts(prompts, s.concurrency, args.requests_per_client)
    with new_client() as client:
        for _ in range(args.warmup):
            run_batch(url, batch, args.max_tokens, 0.0, client, s.concurrency)
        admin(url, {"reset_stats": True}, args.api_key)
        runs = [run_batch(url, batch, args.max_tokens, 0.0, client, s.concurrency)
                for _ in range(args.runs)]
    info = httpx.get(url + "/get_server_info", timeout=60,
                     headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
    prof = info.get("profile", {})
    phases = {k: v["ms_per_step"] for k, v in prof.get("phases", {}).items()}
    spec_stats = info.get("engine", {}).get("extra", {}).get("spec", {})
    tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
    return {
        "setting": s.label, "backend": s.backend, "spec": s.spec, "concurrency": s.concurrency,
        "tok_s": tokens / seconds, "step_ms": prof.get("step_ms_avg", 0.0), "phases_ms": phases,
        "allreduce_ms_per_step": sum(v["ms_per_step"] for v in prof.get("allreduce", {}).values()),
        "allreduce_calls_per_step": sum(v["calls_per_step"] for v in prof.get("allreduce", {}).values()),
        "allreduce_wait_ms_per_step": sum(v.get("wait_ms_per_step", 0.0)
                                          for v in prof.get("allreduce", {}).values()),
        "accept_length": spec_stats.get("avg_accept_length", 1.0) if s.spec else 1.0,
        "position_rates": spec_stats.get("position_accept_rate", []) if s.spec else [],
        "adaptive": (info.get("engine", {}).get("extra", {}).get("spec_adaptive")
                     if s.spec == ADAPTIVE else None),
    }


def to_measurement(row: dict[str, Any]) -> Measurement:
    ph = row["phases_ms"]
    forward = ph.get("verify", 0.0) if row["spec"] else ph.get("decode", 0.0)
    draft = ph.get("draft", 0.0)
    return Measurement(
        backend=row["backend"], concurrency=row["concurrency"],
        num_steps=row["spec"][0] if row["spec"] else 0,
        num_draft_tokens=row["spec"][2] if row["spec"] else 1, tok_s=row["tok_s"],
        forward_ms=forward, draft_ms=draft,
        overhead_ms=max(0.0, row["step_ms"] - forward - draft),
        position_rates=tuple(row["position_rates"]),
    )


def add_predictions(rows: list[dict[str, Any]], extra_steps: list[int]) -> list[dict[str, Any]]:
    """Cost-model tok/s next to every measured row, plus rows for unmeasured chain depths."""
    predicted: list[dict[str, Any]] = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["backend"], row["concurrency"]), []).append(row)
    for (backend, conc), group in groups.items():
        if not any(r["spec"] for r in group) or not any(r["spec"] is None for r in group):
            continue
        fixed = [r for r in group if r["spec"] != ADAPTIVE]  # the model fits pinned settings
        if not any(r["spec"] for r in fixed):
            continue
        model = fit([to_measurement(r) for r in fixed])
        for r in fixed:
            steps, nodes = (r["spec"][0], r["spec"][2]) if r["spec"] else (0, 1)
            r["predicted_tok_s"] = model.tok_s(steps, nodes, conc)
        done = {r["spec"][0] for r in group if r["spec"] and r["spec"][1] == 1}
        for k in (k for k in extra_steps if k not in done):
            predicted.append({"setting": f"{backend} spec={k}/1/{k + 1} c={conc} (predicted)",
                              "backend": backend, "concurrency": conc,
                              "predicted_tok_s": model.tok_s(k, k + 1, conc),
                              "accept_length": model.accept_length(k)})
    return predicted


def start_server(cmd: str, url: str, timeout: float = 600) -> subprocess.Popen:
    proc = subprocess.Popen(shlex.split(cmd), start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: server command exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("error: server did not become healthy")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="launch.ab", description=__doc__.split("\n")[0])
    ap.add_argument("--server-url", default="http://127.0.0.1:30000")
    ap.add_argument("--launch", help="command that starts the server (stopped afterwards)")
    ap.add_argument("--backends", default="gloo,shm")
    ap.add_argument("--spec", default="off,2/1/3,3/1/4", help="comma list: off or steps/topk/tokens")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--requests-per-client", type=int, default=4,
                    help="at concurrency > 1, requests each client sends per run, the next as "
                         "soon as the last is answered (1: one burst)")
    ap.add_argument("--prompts", help="file, one prompt per line (default: built-in)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--predict-steps", default="1,2,3,4,5,6")
    ap.add_argument("--api-key")
    ap.add_argument("--out", default="ab_out")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    url = args.server_url.rstrip("/")
    proc = start_server(args.launch, url) if args.launch else None
    try:
        prompts = list(DEFAULT_PROMPTS)
        if args.prompts:
            prompts = [p.rstrip("\n") for p in open(args.prompts) if p.strip()]
        settings = [Setting(b, parse_spec(s), int(c)) for b in args.backends.split(",")
                    for c in args.concurrency.split(",") for s in args.spec.split(",")]
        rows = []
        for s in settings:
            rows.append(measure(url, s, args, prompts))
            print(f"  measured {s.label}: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    predicted = add_predictions(rows, [int(k) for k in args.predict_steps.split(",")])
    report = {"rows": rows, "predicted": predicted, "verdict": verdict(rows)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps(report, indent=2, default=str))
    print(render_table(rows, predicted))
    write_plot(rows, out / "ab.png")
    print("\n" + report["verdict"])
    print(f"\nwrote {out / 'ab.json'} and {out / 'ab.png'}")
    return report


if __name__ == "__main__":
    main()
