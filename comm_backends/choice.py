"""What ``--allreduce auto`` picks for a measured topology, and the one-line reason why.

A pure table over ``Topology`` and the backends refused on it (by name, with their reasons),
so every row can be tested on a CPU machine from a described topology.

The rules, fastest first where each applies:

* one rank: nothing is ever reduced; take the backend with the cheapest set-up.
* CPU, one node: ``shm`` (shared memory; measured 10-50x faster than gloo at decode sizes on
  the 2-core CI machine), else gloo.
* CPU, several nodes: ``hier`` (shm within each node, gloo among one leader per node) when
  nodes hold more than one rank, else gloo.
* CUDA, several nodes: NCCL, which already runs its own intra-/inter-node hierarchy.
* CUDA, one node, every GPU pair on NVLink: ``cuda_p2p`` (one-shot kernel; latency-bound
  decode messages), else ``symm_mem`` (bf16/fp32: it stages fp16 through fp32, twice the bytes),
  else NCCL.
* CUDA, one node, any pair without NVLink (PCIe) or NVLink unknown: NCCL. The seeds measured a
  custom P2P allreduce on PCIe at half NCCL's speed, and torch's symmetric-memory signal pads
  need native peer atomics PCIe often lacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from comm_backends.topology import Topology


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str


class NoBackend(LookupError):
    """No backend can run on the topology (the message lists why each was refused)."""


def _why_not(refused: Mapping[str, str], *names: str) -> str:
    parts = [f"{n}: {refused[n]}" for n in names if n in refused]
    return f" ({'; '.join(parts)})" if parts else ""


def _cpu(topo: Topology, ok: Mapping[str, bool], refused: Mapping[str, str]) -> Choice:
    if topo.nodes > 1:
        if topo.local_world_size > 1 and ok["hier"]:
            return Choice("hier", f"{topo.nodes} nodes x {topo.local_world_size} ranks: shm within "
                                  "each node, gloo across one leader per node")
        if ok["gloo"]:
            why = "one rank per node" if topo.local_world_size == 1 else "hier refused"
            return Choice("gloo", f"{topo.nodes} nodes, {why}: gloo across all ranks"
                                  + _why_not(refused, "hier"))
    elif ok["shm"]:
        return Choice("shm", f"{topo.world_size} CPU ranks on one node: shared memory "
                             "(10-50x faster than gloo at decode sizes)")
    elif ok["gloo"]:
        return Choice("gloo", "shm refused" + _why_not(refused, "shm"))
    raise NoBackend(f"no allreduce backend for {topo.describe()}" + _why_not(refused, *refused))


def _cuda_one_node(topo: Topology, ok: Mapping[str, bool], refused: Mapping[str, str]) -> Choice:
    gpus = topo.local_world_size
    if topo.nvlink is None:
        return Choice("nccl", f"{gpus} GPUs, NVLink unknown (NVML not readable): NCCL")
    pair = topo.missing_pair(topo.nvlink)
    if pair is not None:
        return Choice("nccl", f"{gpus} GPUs, GPU {pair[0]}-{pair[1]} without NVLink (PCIe): NCCL "
                              "(a custom P2P allreduce measured at half NCCL's speed on PCIe)")
    if ok["cuda_p2p"]:
        return Choice("cuda_p2p", f"{gpus} GPUs, all pairs on NVLink: the one-/two-shot P2P kernel")
    if ok["symm_mem"] and topo.dtype != torch.float16:
        return Choice("symm_mem", f"{gpus} GPUs, all pairs on NVLink: torch symmetric memory"
                                  + _why_not(refused, "cuda_p2p"))
    fp16 = " symm_mem would stage fp16 through fp32;" if ok["symm_mem"] else ""
    return Choice("nccl", f"{gpus} GPUs on NVLink, NCCL:{fp16}"
                          + _why_not(refused, "cuda_p2p", "symm_mem"))


def choose_backend(topo: Topology, refused: Mapping[str, str]) -> Choice:
    """The backend ``auto`` means on ``topo``; ``refused`` maps backends that cannot run to why.

    Raises NoBackend when nothing suitable is left.
    """
    names = ("gloo", "shm", "hier", "nccl", "cuda_p2p", "symm_mem")
    ok = {n: n not in refused for n in names}
    if topo.device == "cpu":
        if topo.world_size == 1:
            return Choice("shm" if ok["shm"] else "gloo", "one rank: nothing to reduce")
        return _cpu(topo, ok, refused)
    if topo.world_size == 1:  # never reduces: any CUDA backend that can be built will do
        for name in ("nccl", "symm_mem", "cuda_p2p"):
            if ok[name]:
                return Choice(name, "one rank: nothing to reduce")
    if not ok["nccl"]:
        raise NoBackend(f"no allreduce backend for {topo.describe()}" + _why_not(refused, *refused))
    if topo.nodes > 1:
        return Choice("nccl", f"{topo.nodes} nodes x {topo.local_world_size} GPUs: NCCL "
                              "(its own intra-/inter-node hierarchy)")
    return _cuda_one_node(topo, ok, refused)
