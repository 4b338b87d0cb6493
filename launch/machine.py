"""What the benchmark ran on: CPU model, the SIMD/matrix flags that decide kernel paths, cores."""

from __future__ import annotations

import os
from pathlib import Path

# Flags that change which kernels llama.cpp and torch can use on x86 (and their Arm analogues).
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


def parse_cpuinfo(text: str) -> dict[str, object]:
    """Model name and the FLAGS present, from /proc/cpuinfo's first processor block."""
    model, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model == "unknown":
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return {"model": model, "flags": [f for f in FLAGS if f in flags]}


def machine_info() -> dict[str, object]:
    path = Path("/proc/cpuinfo")
    info = parse_cpuinfo(path.read_text() if path.is_file() else "")
    info["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return info


def describe(info: dict[str, object]) -> str:
    flags = ", ".join(info["flags"]) or "none of " + ", ".join(FLAGS[:6])  # type: ignore[arg-type]
    return f"{info['model']}, {info['cpus']} CPUs usable; flags: {flags}"
