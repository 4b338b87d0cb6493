"""Weight formats: how a linear layer stores its weight and multiplies by it.

``DenseWeights`` builds the plain column/row-parallel layers of ``linear.py`` (bf16, fp16,
fp32; the fast bf16 path is untouched). ``Fp8BlockWeights`` builds FP8 layers for the modules
the checkpoint stores in FP8 (those with a ``weight_scale_inv``): 1 byte per weight plus one
float32 scale per block, sharded per rank with their scales. A model asks its format for each
projection by checkpoint prefix, so a checkpoint that keeps some modules unquantised works.

Shards must start on a block boundary and, except at the end of the tensor, cover whole
blocks: a scale then belongs to exactly one rank. DeepSeek-V3 at TP 8 (128x128 blocks) is
aligned everywhere; an unaligned TP size is refused with the layer named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tpserve.errors import ConfigError
from tpserve.layers.fp8 import FP8, Block, fp8_linear
from tpserve.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    _param,
    copy_into,
    linear,
    load_replicated,
)
from tpserve.layers.tp import TPContext


def require_fp8(source: Any, what: str) -> None:
    dtype = source.dtype if isinstance(source, torch.Tensor) else source.get_dtype()
    if dtype not in (FP8, "F8_E4M3"):
        raise ValueError(f"{what}: expected a float8_e4m3fn weight, got {dtype}")


def check_aligned(start: int, size: int, total: int, block: int, what: str) -> None:
    if start % block or (size % block and start + size != total):
        raise ConfigError(f"FP8 {what}: a shard of {size} rows/columns at offset {start} cuts "
                          f"a {block}-wide scale block; use a tensor-parallel size that "
                          "splits it on block boundaries")


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel FP8 weight: rows split per rank, scale rows split with them."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype, device: torch.device, block: Block, name: str) -> None:
        # Built on the meta device first: the dense weight is never allocated.
        super().__init__(in_features, out_sizes, bias, tp, dtype, torch.device("meta"))
        self.block, self.name = block, name
        for shard, total in enumerate(out_sizes):
            _, start, size = self.shard_range(shard)
            last = shard == len(out_sizes) - 1
            check_aligned(start, size, total if last else -1, block[0], f"{name} (output)")
        self.weight = _param(tuple(self.weight.shape), FP8, device)
        self.weight.weight_loader = self.load_shard
        if bias:
            self.bias = _param((sum(self.out_sizes),), dtype, device)
            self.bias.weight_loader = self.load_shard
        scale_rows = sum(math.ceil(s / block[0]) for s in self.out_sizes)
        self.weight_scale_inv = _param((scale_rows, math.ceil(in_features / block[1])),
                                       torch.float32, device)
        self.weight_scale_inv.weight_loader = self.load_scale

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        if param is self.weight:
            require_fp8(source, self.name)
        super().load_shard(param, source, shard_id)

    def load_scale(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        local, start, size = self.shard_range(shard_id or 0)
        bo = self.block[0]
        rows = math.ceil(size / bo)
        copy_into(param.data[local // bo: local // bo + rows],
                  source[start // bo: start // bo + rows], f"{self.name} scales")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.weight, self.weight_scale_inv, self.block)
        return y if self.bias is None else y + self.bias


class Fp8RowParallelLinear(RowParallelLinear):
    """Row-parallel FP8 weight: input columns split per rank, scale columns split with them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype, device: torch.device, block: Block, name: str) -> None:
        super().__init__(in_features, out_features, bias, tp, dtype, torch.device("meta"))
        if bias:
            self.bias = _param((out_features,), dtype, device)
            self.bias.weight_loader = load_replicated
        self.block, self.name = block, name
        check_aligned(tp.rank * self.in_local, self.in_local, in_features, block[1],
                      f"{name} (input)")
        self.weight = _param(tuple(self.weight.shape), FP8, device)
        self.weight.weight_loader = self.load_weight
        self.weight_scale_inv = _param((math.ceil(out_features / block[0]),
                                        math.ceil(self.in_local / block[1])), torch.float32,
                                       device)
        self.weight_scale_inv.weight_loader = self.load_scale

    def load_weight(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        require_fp8(source, self.name)
        super().load_weight(param, source, shard_id)

    def load_scale(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        bi = self.block[1]
        start = self.tp.rank * self.in_local // bi
        copy_into(param.data, source[:, start: start + param.shape[1]], f"{self.name} scales")

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.comm.all_reduce(self.partial(x))
        return y if self.bias is None else y + self.bias


def row_partial(layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's local partial sum, before any allreduce (bias not added)."""
    if isinstance(layer, Fp8RowParallelLinear):
        return layer.partial(x)
    return linear(x, layer.weight)


class WeightFormat(Protocol):
    """Builds each projection of a model for one checkpoint's weight storage."""

    def column(self, name: str, in_features: int, out_sizes: list[int], bias: bool,
               tp: TPContext, dtype: torch.dtype, device: torch.device
               ) -> ColumnParallelLinear: ...

    def row(self, name: str, in_features: int, out_features: int, bias: bool, tp: TPContext,
            dtype: torch.dtype, device: torch.device) -> RowParallelLinear: ...

    def block_for(self, name: str) -> Block | None: ...


class DenseWeights:
    """Unquantised weights in the model dtype."""

    def column(self, name: str, in_features: int, out_sizes: list[int], bias: bool,
               tp: TPContext, dtype: torch.dtype, device: torch.device
               ) -> ColumnParallelLinear:
        return ColumnParallelLinear(in_features, out_sizes, bias, tp, dtype, device)

    def row(self, name: str, in_features: int, out_features: int, bias: bool, tp: TPContext,
            dtype: torch.dtype, device: torch.device) -> RowParallelLinear:
        return RowParallelLinear(in_features, out_features, bias, tp, dtype, device)

    def block_for(self, name: str) -> Block | None:
        return None


@dataclass(frozen=True)
class Fp8BlockWeights(DenseWeights):
    """FP8 for every module in ``quantized`` (checkpoint prefixes that carry scales)."""

    block: Block
    quantized: frozenset[str]

    def block_for(self, name: str) -> Block | None:
        return self.block if name in self.quantized else None

    def column(self, name: str, in_features: int, out_sizes: list[int], bias: bool,
               tp: TPContext, dtype: torch.dtype, device: torch.device
               ) -> ColumnParallelLinear:
        if name not in self.quantized:
            return super().column(name, in_features, out_sizes, bias, tp, dtype, device)
        return Fp8ColumnParallelLinear(in_features, out_sizes, bias, tp, dtype, device,
                                       self.block, name)

    def row(self, name: str, in_features: int, out_features: int, bias: bool, tp: TPContext,
            dtype: torch.dtype, device: torch.device) -> RowParallelLinear:
        if name not in self.quantized:
            return super().row(name, in_features, out_features, bias, tp, dtype, device)
        return Fp8RowParallelLinear(in_features, out_features, bias, tp, dtype, device,
                                    self.block, name)


def quantized_modules(tensor_names: Iterable[str]) -> frozenset[str]:
    """Checkpoint prefixes stored in FP8: those with a ``weight_scale_inv`` beside the weight."""
    suffix = ".weight_scale_inv"
    return frozenset(n[: -len(suffix)] for n in tensor_names if n.endswith(suffix))


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter this rank holds (FP8 weights count 1 byte, scales 4)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
