"""What ``--allreduce auto`` picks for a described topology, and why (no GPU needed).

The topologies are written out as the hardware would report them (P2P, native atomics and
NVLink matrices per local GPU pair); refusals come from the backends' own topology checks,
so the table and the backends' requirements are tested together.
"""

from __future__ import annotations

import pytest
import torch

import comm_backends
from comm_backends.choice import NoBackend, choose_backend
from comm_backends.cuda_probe import CudaPeerProbe, DriverApi, Nvml
from comm_backends.topology import Placement, Topology, measure


def full(n: int, value: bool = True) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(True if a == b else value for b in range(n)) for a in range(n))


def gpus(n: int, nvlink: bool | None = True, atomics: bool = True, nodes: int = 1,
         dtype: torch.dtype | None = torch.bfloat16) -> Topology:
    return Topology("cuda", n * nodes, n, nodes, dtype, gpus_visible=n, capability=(9, 0),
                    p2p=full(n), atomics=full(n, atomics),
                    nvlink=None if nvlink is None else full(n, nvlink))


def hardware_refusals(topo: Topology, software: dict[str, str] | None = None) -> dict[str, str]:
    """Refusals from the topology alone (pure), plus stated software gaps (e.g. no cupy)."""
    return {**comm_backends.refusals(topo, environment=False), **(software or {})}


def pick(topo: Topology, software: dict[str, str] | None = None) -> comm_backends.Choice:
    return choose_backend(topo, hardware_refusals(topo, software))


# ---------------------------------------------------------------------------- CPU
def test_cpu_one_node_prefers_shm_then_gloo() -> None:
    topo = Topology("cpu", 4, 4)
    assert pick(topo).name == "shm"
    fallback = pick(topo, {"shm": "allreduce backend 'shm' relies on x86-64 memory ordering"})
    assert fallback.name == "gloo" and "x86-64" in fallback.reason


def test_cpu_several_nodes_never_spans_them_with_shm() -> None:
    two_by_two = Topology("cpu", 4, 2, nodes=2)
    assert "one node" in hardware_refusals(two_by_two)["shm"]
    choice = pick(two_by_two)
    assert choice.name == "hier" and "2 nodes x 2 ranks" in choice.reason
    one_per_node = Topology("cpu", 3, 1, nodes=3)
    assert pick(one_per_node).name == "gloo"


# ---------------------------------------------------------------------------- CUDA
def test_all_nvlink_prefers_the_p2p_kernel_then_symm_mem_then_nccl() -> None:
    topo = gpus(8)
    assert pick(topo).name == "cuda_p2p"
    no_cupy = {"cuda_p2p": "allreduce backend 'cuda_p2p' needs cupy: pip install tpserve[gpu]"}
    second = pick(topo, no_cupy)
    assert second.name == "symm_mem" and "needs cupy" in second.reason
    # symm_mem would stage fp16 through fp32 (twice the bytes): NCCL instead.
    assert pick(gpus(8, dtype=torch.float16), no_cupy).name == "nccl"


def test_pcie_prefers_nccl_over_the_custom_kernel() -> None:
    topo = gpus(4, nvlink=False)
    assert "cuda_p2p" not in hardware_refusals(topo)  # it could run, just slower
    choice = pick(topo)
    assert choice.name == "nccl" and "PCIe" in choice.reason and "\n" not in choice.reason
    matrix = [list(row) for row in full(4)]
    matrix[1][3] = matrix[3][1] = False
    mixed = Topology("cuda", 4, 4, 1, torch.bfloat16, 4, (9, 0), full(4), full(4),
                     tuple(tuple(r) for r in matrix))
    assert pick(mixed).name == "nccl" and "GPU 1-3" in pick(mixed).reason


def test_unknown_nvlink_is_treated_as_absent() -> None:
    assert pick(gpus(2, nvlink=None)).name == "nccl"


def test_symm_mem_refuses_pcie_without_atomics_and_missing_p2p() -> None:
    no_atomics = hardware_refusals(gpus(4, nvlink=False, atomics=False))
    assert "native peer atomics between GPU 0 and 1" in no_atomics["symm_mem"]
    cut = Topology("cuda", 2, 2, 1, None, 2, (9, 0), full(2, False), full(2), full(2))
    refused = hardware_refusals(cut)
    assert "P2P not available between GPU 0 and 1" in refused["symm_mem"]
    assert "P2P not available between GPU 0 and 1" in refused["cuda_p2p"]
    old = Topology("cuda", 2, 2, 1, None, 2, (7, 5), full(2), full(2), full(2))
    assert "compute capability 8.0" in hardware_refusals(old)["symm_mem"]
    assert "cuda_p2p" not in hardware_refusals(old)


def test_single_node_backends_refuse_to_span_nodes_in_one_line() -> None:
    topo = gpus(8, nodes=2)
    refused = hardware_refusals(topo)
    for name in ("cuda_p2p", "symm_mem"):
        assert "spans 2 nodes" in refused[name] and "\n" not in refused[name], refused[name]
    assert pick(topo).name == "nccl"
    mnnvl = Topology("cuda", 16, 8, 2, None, 8, (10, 0), full(8), full(8), full(8),
                     multinode_nvlink=True)
    assert "symm_mem" not in hardware_refusals(mnnvl)


def test_fewer_gpus_than_ranks_refuses_the_p2p_kernel() -> None:
    topo = Topology("cuda", 4, 4, 1, None, 2, (9, 0), full(2), full(2), full(2))
    assert "2 visible, 4 ranks" in hardware_refusals(topo)["cuda_p2p"]


def test_one_rank_and_nothing_left() -> None:
    assert pick(gpus(1)).name == "nccl"
    assert pick(Topology("cpu", 1, 1)).reason == "one rank: nothing to reduce"
    with pytest.raises(NoBackend, match="nccl: needs a torch build with NCCL"):
        choose_backend(gpus(2), {"nccl": "needs a torch build with NCCL"})


def test_one_gpu_does_not_need_nccl() -> None:
    """One rank never reduces: a torch without NCCL still runs a one-GPU job under ``auto``."""
    no_nccl = {"nccl": "needs a torch build with NCCL", "cuda_p2p": "needs cupy"}
    assert pick(gpus(1), no_nccl).name == "symm_mem"
    with pytest.raises(NoBackend):
        pick(gpus(1), {**no_nccl, "symm_mem": "no symmetric memory"})


# ---------------------------------------------------------------------------- measuring
class FakeProbe:
    """Four GPUs: 0-1 and 2-3 NVLink pairs, P2P everywhere, atomics only within pairs."""

    def device_count(self) -> int:
        return 4

    def capability(self, device: int) -> tuple[int, int]:
        return (9, 0)

    def can_access(self, a: int, b: int) -> bool:
        return True

    def native_atomics(self, a: int, b: int) -> bool | None:
        return a // 2 == b // 2

    def nvlink(self, a: int, b: int) -> bool | None:
        return a // 2 == b // 2


def test_measure_fills_the_matrices_from_the_probe() -> None:
    topo = measure(torch.device("cuda", 0), Placement(0, 4, 0, 4, 0), torch.bfloat16, FakeProbe())
    assert topo.nvlink == ((True, True, False, False), (True, True, False, False),
                           (False, False, True, True), (False, False, True, True))
    assert topo.missing_pair(topo.nvlink) == (0, 2)
    assert topo.missing_pair(topo.p2p) is None
    choice = pick(topo)
    assert choice.name == "nccl" and "GPU 0-2" in choice.reason
    assert "atomics" in hardware_refusals(topo)["symm_mem"]
    two = measure(torch.device("cuda", 0), Placement(0, 2, 0, 2, 0), None, FakeProbe())
    assert pick(two).name == "cuda_p2p"


def test_probe_answers_unknown_without_the_libraries() -> None:
    probe = CudaPeerProbe(DriverApi("libcuda-missing.so"), Nvml("libnvml-missing.so"))
    assert probe.native_atomics(0, 1) is None and probe.nvlink(0, 1) is None


def test_placement_follows_torchrun_nodes_not_hostnames() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_RANK": "1"}
    where = Placement.from_env(env)
    assert (where.node_rank, where.nodes, where.local_rank) == (1, 2, 1)
    from comm_backends.topology import node_key

    assert node_key({"GROUP_RANK": "0"}) != node_key({"GROUP_RANK": "1"})
