"""The symm_mem backend's host logic, the hier local choice and the torch.distributed body on
CPU: torch's symmetric-memory module, kernels and process group are replaced by fakes that
check what the real ones require (a symmetric buffer, 16-byte sizes, bf16/fp32 only) and sum
a world of ``WORLD`` identical ranks (x * WORLD, exact in every dtype used here).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist

import comm_backends.symm_mem as sm
from comm_backends.base import BackendUnavailable
from comm_backends.hier import HierAllReduce
from comm_backends.topology import Topology
from comm_backends.torch_dist import NcclAllReduce

WORLD = 4


def _full(n: int, value: bool = True) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(True if a == b else value for b in range(n)) for a in range(n))


# ---------------------------------------------------------------------------- multicast probe
class _Handle:
    """A rendezvous handle: the device could multicast, the buffer may still have no mapping."""

    def __init__(self, multicast_ptr: int) -> None:
        self.multicast_ptr = multicast_ptr

    @staticmethod
    def has_multicast_support(device_type: object = None, index: int = 0) -> bool:
        return True  # torch's static, device-level answer


def test_multicast_follows_the_buffer_mapping_not_the_device() -> None:
    # torch skips a group's multicast set-up with a warning when cuMulticastCreate / bind
    # fails; the multimem kernels then refuse ("multicast support is required").
    assert sm._multicast(_Handle(0)) is False
    assert sm._multicast(_Handle(0x7F0000000000)) is True
    assert sm._multicast(object()) is False  # a torch without multicast_ptr: plain kernels


# ---------------------------------------------------------------------------- fake world
class _FakeKernels:
    """torch.ops.symm_mem's allreduce ops, with torch's input checks."""

    def __init__(self, bufs: list[torch.Tensor]) -> None:
        self.bufs, self.calls = bufs, []

    def _check(self, op: str, x: torch.Tensor, out: torch.Tensor | None = None) -> None:
        assert x.dtype in (torch.float32, torch.bfloat16), f"{op}: no kernel for {x.dtype}"
        assert x.is_contiguous()
        assert any(x.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                   for b in self.bufs), f"{op}: input is not a symmetric buffer"
        assert (x.numel() * x.element_size()) % 16 == 0, f"{op}: size not 16-byte aligned"
        if out is not None:
            assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
        self.calls.append(op)

    def one_shot_all_reduce_out(self, x: torch.Tensor, op: str, name: str, out: torch.Tensor
                                ) -> torch.Tensor:
        self._check("one_shot", x, out)
        return out.copy_(x * WORLD)

    def multimem_one_shot_all_reduce_out(self, x: torch.Tensor, op: str, name: str,
                                         out: torch.Tensor) -> torch.Tensor:
        self._check("multimem_one_shot", x, out)
        return out.copy_(x * WORLD)

    def two_shot_all_reduce_(self, x: torch.Tensor, op: str, name: str) -> torch.Tensor:
        self._check("two_shot", x)
        return x.mul_(WORLD)

    def multimem_all_reduce_(self, x: torch.Tensor, op: str, name: str) -> torch.Tensor:
        self._check("multimem", x)
        return x.mul_(WORLD)


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A process group of WORLD ranks where this rank's peers answer ``state['peer_flags']``."""
    import torch.distributed._symmetric_memory as symm

    state: dict[str, Any] = {"bufs": [], "multicast_ptr": 0, "peer_flags": True}
    kernels = _FakeKernels(state["bufs"])
    state["kernels"] = kernels

    def empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = torch.empty(numel, dtype=dtype)
        state["bufs"].append(buf)
        return buf

    def all_gather_object(out: list, obj: object, group: object = None) -> None:
        out[0] = obj
        for r in range(1, len(out)):
            out[r] = state["peer_flags"] if isinstance(obj, bool) else None

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(symm, "empty", empty)
    monkeypatch.setattr(symm, "rendezvous", lambda t, g: _Handle(state["multicast_ptr"]))
    monkeypatch.setattr(symm, "is_symm_mem_enabled_for_group", lambda name: True)
    monkeypatch.setattr(torch.ops, "symm_mem", kernels)
    return state


def _backend(**config: Any) -> sm.SymmMemAllReduce:
    group = types.SimpleNamespace(group_name="0")  # stands in for the ProcessGroup
    return sm.SymmMemAllReduce(group, torch.device("cpu"), sm.SymmMemConfig(**config))  # type: ignore[arg-type]


def test_multimem_only_where_every_rank_has_a_mapping(fake_world: dict[str, Any]) -> None:
    assert _backend()._multimem is False  # no mapping here
    fake_world["multicast_ptr"] = 1 << 40
    assert _backend()._multimem is True
    fake_world["peer_flags"] = False  # a peer without one: nobody uses multimem
    assert _backend()._multimem is False
    fake_world["peer_flags"] = True
    assert _backend(use_multimem=False)._multimem is False


@pytest.mark.parametrize("multicast", [False, True])
@pytest.mark.parametrize("two_shot_bytes", [1 << 40, 0])
def test_staging_chunks_pads_and_widens(fake_world: dict[str, Any], multicast: bool,
                                        two_shot_bytes: int) -> None:
    fake_world["multicast_ptr"] = (1 << 40) if multicast else 0
    backend = _backend(buffer_bytes=256, two_shot_bytes=two_shot_bytes)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 7, 8, 63, 64, 65, 200, 1001):  # inside, at and across the 256-byte buffer
            x = torch.randint(-50, 50, (n,), generator=gen).to(dtype)
            assert torch.equal(backend.all_reduce(x.clone()), x * WORLD), (dtype, n)
        wide = torch.randint(-50, 50, (6, 10), generator=gen).to(dtype)
        before = wide.clone()
        strided = wide[:, ::3]  # not contiguous: reduced in a copy, written back in place
        assert backend.all_reduce(strided) is strided
        assert torch.equal(wide[:, ::3], before[:, ::3] * WORLD)
        assert torch.equal(wide[:, 1::3], before[:, 1::3])  # the rest untouched
    kinds = set(fake_world["kernels"].calls)
    plain = {"one_shot"} if two_shot_bytes else {"two_shot"}
    assert kinds == ({"multimem" + ("_one_shot" if two_shot_bytes else "")} if multicast else plain)


def test_buffer_size_must_keep_chunks_16_byte_aligned(fake_world: dict[str, Any]) -> None:
    with pytest.raises(BackendUnavailable, match="multiple of 16"):
        _backend(buffer_bytes=1000)


def test_a_failed_allocation_is_one_refusal_naming_the_rank(fake_world: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed._symmetric_memory as symm

    def no_memory(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory\nsecond line")

    monkeypatch.setattr(symm, "empty", no_memory)
    with pytest.raises(BackendUnavailable) as err:
        _backend()
    assert str(err.value) == ("allreduce backend 'symm_mem' failed to set up: "
                              "rank 0: CUDA error: out of memory second line")


# ---------------------------------------------------------------------------- hier local choice
def test_hier_local_backend_is_the_same_on_every_rank_of_a_node() -> None:
    """Each rank's view of its node: the leader's topology decides, and a backend any rank of
    the node refuses is out for all of them (else set-up collectives would differ and hang)."""
    hier = object.__new__(HierAllReduce)
    hier.device = torch.device("cuda", 0)
    topo = Topology("cuda", 4, 4, 1, None, 4, (9, 0), _full(4), _full(4), _full(4))
    no_cupy = {"cuda_p2p": "allreduce backend 'cuda_p2p' needs cupy"}
    views = [(topo, {}), (topo, no_cupy), (topo, {}), (topo, {})]
    assert hier._local_name(dict(enumerate(views)), 0) == "symm_mem"
    assert hier._local_name(dict(enumerate([(topo, {})] * 4)), 0) == "cuda_p2p"
    pcie = Topology("cuda", 4, 4, 1, None, 4, (9, 0), _full(4), _full(4), _full(4, False))
    assert hier._local_name(dict(enumerate([(pcie, {}), (topo, {}), (topo, {}), (topo, {})])),
                            0) == "nccl"


# ---------------------------------------------------------------------------- torch.distributed
def test_nccl_body_reduces_non_contiguous_tensors_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    def all_reduce(t: torch.Tensor, op: object = None, group: object = None) -> None:
        if not t.is_contiguous():  # what ProcessGroupNCCL says
            raise ValueError("Tensors must be contiguous")
        t.mul_(WORLD)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    backend = object.__new__(NcclAllReduce)
    backend.group = None
    x = torch.arange(12.0).view(3, 4)
    col = x[:, 1]
    assert backend._all_reduce(col) is col
    assert torch.equal(x[:, 1], torch.tensor([1.0, 5.0, 9.0]) * WORLD)
    assert torch.equal(x[:, 0], torch.tensor([0.0, 4.0, 8.0]))
