"""Running llama.cpp's native tools on the benchmark's GGUF: the comparison side of bench_served.

The tools come from ``launch/build_llamacpp.sh`` (an optional build into
``$TPSERVE_CACHE/llamacpp/<version>/build/bin``) or from PATH. Each measurement is one
invocation with ``-r 1`` (a single repetition after llama.cpp's own warm-up run): repetitions
come from bench_served's rounds, which alternate with tpserve so that both see the same
machine conditions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launch.llamacpp_output import BatchedRow, BenchTest, parse_batched_bench, parse_llama_bench

TOOLS = ("llama-bench", "llama-batched-bench", "llama-simple")


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path
    gguf: Path
    threads: int

    def tool(self, name: str) -> Path:
        return self.bin_dir / name

    def bench(self, *flags: str) -> list[BenchTest]:
        """llama-bench with these test flags (``-p``, ``-n``, ``-d`` ...), JSON parsed."""
        out = self._run("llama-bench", "-m", str(self.gguf), "-t", str(self.threads), "-r", "1",
                        "-o", "json", *flags)
        return parse_llama_bench(out)

    def batched(self, prompt: int, gen: int, parallel: list[int]) -> list[BatchedRow]:
        """llama-batched-bench: ``parallel`` sequence counts, each PP prompt + TG new tokens."""
        ctx = max(parallel) * (prompt + gen) + 256
        return parse_batched_bench(self._run(
            "llama-batched-bench", "-m", str(self.gguf), "-t", str(self.threads),
            "-tb", str(self.threads), "-c", str(ctx), "-b", "2048", "-ub", "512",
            "-npp", str(prompt), "-ntg", str(gen), "-npl", ",".join(map(str, parallel))))

    def greedy(self, prompt: str, tokens: int) -> str:
        """llama-simple's stdout: the prompt then ``tokens`` greedy pieces."""
        return self._run("llama-simple", "-m", str(self.gguf), "-n", str(tokens), prompt)

    def _run(self, name: str, *args: str) -> str:
        proc = subprocess.run([str(self.tool(name)), *args], capture_output=True, text=True,
                              errors="replace", timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        # batched-bench logs its table to stderr in some versions, stdout in others
        return proc.stdout if name != "llama-batched-bench" else proc.stdout + proc.stderr


def cache_dir() -> Path:
    return Path(os.environ.get("TPSERVE_CACHE", Path.home() / ".cache" / "tpserve")) / "llamacpp"


def find_bin_dir(explicit: Path | None = None) -> tuple[Path | None, str]:
    """(directory holding all of TOOLS, "") or (None, why not): --llamacpp-bin, cache, PATH."""
    candidates = [explicit] if explicit else []
    if not explicit:
        builds = sorted(cache_dir().glob("*/build/bin"), key=lambda p: p.stat().st_mtime)
        candidates += reversed(builds)
        on_path = shutil.which(TOOLS[0])
        if on_path:
            candidates.append(Path(on_path).parent)
    for d in candidates:
        if d is not None and all(os.access(d / t, os.X_OK) for t in TOOLS):
            return d, ""
    where = str(explicit) if explicit else f"{cache_dir()}/*/build/bin or PATH"
    return None, (f"llama.cpp tools ({', '.join(TOOLS)}) not found in {where}; "
                  "build them with launch/build_llamacpp.sh")
