"""The tensor-parallel context a layer needs: which shard it is, and how to reduce."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts
