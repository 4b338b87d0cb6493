"""Versions, the GPU pair matrices and what ``auto`` would pick: the GPU check's first step.

    python -m comm_backends.topology_report [--ranks N] [--json FILE] [--require a,b]

Prints torch / CUDA / NCCL / driver / cupy / NVRTC versions, every visible GPU, the P2P,
native-atomics and NVLink matrices, each backend's refusal (if any) for N ranks on this node,
and ``auto``'s choice with its reason. Exits 1 if a backend named in ``--require`` (default:
env REQUIRE) is refused, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any

import torch

import comm_backends
from comm_backends.topology import Placement, Topology, measure


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Any]:
    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "driver": _driver_version(),
        "cupy": _version("cupy-cuda12x") or _version("cupy-cuda13x") or _version("cupy"),
        "nvrtc": _version("nvidia-cuda-nvrtc-cu12") or _version("nvidia-cuda-nvrtc"),
        "python": sys.version.split()[0],
    }


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return None


def _grid(name: str, matrix: Any) -> list[str]:
    if matrix is None:
        return [f"{name}: unknown"]
    n = len(matrix)
    lines = [f"{name}:", "      " + " ".join(f"{b:>3}" for b in range(n))]
    for a, row in enumerate(matrix):
        lines.append(f"  {a:>3} " + " ".join(f"{'-' if a == b else 'Y' if v else '.':>3}"
                                            for b, v in enumerate(row)))
    return lines


def report(ranks: int) -> tuple[dict[str, Any], list[str]]:
    topo: Topology = measure(torch.device("cuda", 0), Placement(0, ranks, 0, ranks, 0))
    refused = comm_backends.refusals(topo)
    try:
        choice = comm_backends.choose(topo, refused)
        auto = {"name": choice.name, "reason": choice.reason}
    except comm_backends.BackendUnavailable as exc:
        auto = {"name": None, "reason": str(exc)}
    gpus = [{"index": i, "name": torch.cuda.get_device_name(i),
             "capability": list(torch.cuda.get_device_capability(i))}
            for i in range(torch.cuda.device_count())]
    data = {"versions": versions(), "gpus": gpus, "ranks": ranks, "p2p": topo.p2p,
            "atomics": topo.atomics, "nvlink": topo.nvlink, "refused": refused, "auto": auto}
    lines = [f"{k}: {v}" for k, v in data["versions"].items()]
    lines += [f"GPU {g['index']}: {g['name']} cc {tuple(g['capability'])}" for g in gpus]
    for name in ("p2p", "atomics", "nvlink"):
        lines += _grid(name, data[name])
    lines += [f"refused {name}: {why}" for name, why in refused.items()]
    lines.append(f"auto at {ranks} rank(s) -> {auto['name']}: {auto['reason']}")
    return data, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m comm_backends.topology_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=0, help="ranks on this node (default: all GPUs)")
    p.add_argument("--json", default=None)
    p.add_argument("--require", default=os.environ.get("REQUIRE", ""))
    ns = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("topology_report: no CUDA GPU visible", file=sys.stderr)
        return 2
    data, lines = report(ns.ranks or torch.cuda.device_count())
    print("\n".join(lines))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(data, f, indent=2)
    missing = [n.strip() for n in ns.require.split(",") if n.strip() in data["refused"]]
    for name in missing:
        print(f"REQUIRED backend {name} is refused: {data['refused'][name]}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
