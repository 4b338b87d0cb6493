"""The tensor-parallel context a layer needs: which shard it is, and how to reduce."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class Reducer(Protocol):
    """What layers call for cross-rank communication (an AllReduce or a switch over several)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...


class NoComm:
    """Single-rank reducer: both operations are the identity."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


@dataclass(frozen=True)
class TPContext:
    rank: int
    size: int
    comm: Reducer
    # Expert parallelism (--ep-size): 1 splits every expert across the TP ranks like an MLP;
    # equal to ``size``, each rank holds whole experts (MoE layers only).
    ep_size: int = 1

    @staticmethod
    def single() -> TPContext:
        return TPContext(rank=0, size=1, comm=NoComm())


def native_exchange(comm: Any, dtype: torch.dtype, shape: torch.Size) -> Any:
    """The backend's compiled exchange for allreduces of ``shape`` run from native code
    (``AllReduce.stack_exchange``), or None where ``comm`` has none for it (the caller then
    reduces through ``comm`` itself)."""
    stack = getattr(comm, "stack_exchange", None)
    return stack(dtype, shape) if stack is not None else None


def run_exchanging(comm: Any, ex: Any, calls: int, nbytes: int,
                   op: Callable[[list[int]], T]) -> T:
    """``op(ex.args())``, a native call that runs ``calls`` allreduces of ``nbytes`` through
    ``ex``; the backend is told they ran (``stack_exchanged``: its sequence and statistics)
    or that the call failed midway (``stack_failed``: its peers must not wait on it)."""
    try:
        out = op(ex.args())
    except RuntimeError as exc:
        comm.stack_failed(str(exc))
        raise
    comm.stack_exchanged(ex, calls, nbytes)
    return out


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts
