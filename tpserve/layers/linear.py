"""Column- and row-parallel linear layers with per-parameter weight loaders.

Each parameter carries a ``weight_loader(param, source, shard_id)`` that copies just this
rank's slice out of ``source`` (a safetensors slice or a tensor), so the loader never
materialises a full weight on a rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.layers import cpu_ops
from tpserve.layers.tp import TPContext, divide

# Every CPU projection of 16-bit weights goes through tpserve::matmul (gemm.c), at any row
# count: each output is then one fixed sum whatever rows share its call, so a token's bits do
# not depend on how it was batched (a prefix hit's recomputed tail, a chunked or preempted
# prompt, decode rows beside a prompt chunk, a speculative verify beside plain decode). ATen's
# oneDNN gemm rounds a row differently with the row count: on a 2-vCPU Xeon with AMX, a 512 x
# 1536 projection's rows at 4-36 rows differ from the same rows at 300, and with it above 8
# rows a repeated 150-token prompt's greedy output on the bench model changed on a prefix hit.
# Speed, `python -m launch.bench_gemm --threads 2` (ms for one step's projections of the
# hidden-512 x 8-layer model, ours vs F.linear): on that Xeon gemm.c's AMX tiles (gemm_amx.c)
# 1.4 vs 3.5 at 1 row, 1.6-2.3 vs 3.5-4.3 at 16, 5.6-5.9 vs 6.4-7.1 at 64, 14-15 vs 11-12 at
# 256 (with TPSERVE_AMX=0, the AVX512-BF16 tiles: 1.3-1.4, 5.6-6.5, 22-24, 83). On a 2-vCPU
# AVX-512 EPYC without AMX, ATen/ours 1.00-1.16 up to 16 rows, 0.71-0.81 at 64-512; on AVX2
# CPUs (Zen 3) ours is 4-5.5x faster from 8 to 64 rows (oneDNN's AVX2 bf16 gemm stays at ~9
# GFLOP/s). TPSERVE_NATIVE_GEMM=0 sends every projection to ATen (cpu_ops.cpp).


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear``, but CPU projections go through ``tpserve::matmul`` (``cpu_ops``; see the
    note above for why at every row count).

    Decode steps do little but stream the weights, and ATen's CPU matmul (a oneDNN gemm)
    streams bf16 weights at a fraction of our kernel's rate, which splits the weight rows
    across its own threads and reads each weight once per block of rows. The op is opaque to inductor, so
    compiled decode rounds exactly like eager; and each output's arithmetic does not depend on
    the other rows in the call or the thread count, so a token's logits are the same in plain
    decode and in a verify batch.
    """
    if x.dim() != 2 or not x.is_cpu:
        return F.linear(x, weight, bias)
    y = torch.ops.tpserve.matmul(x, weight)
    return y if bias is None else y + bias


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    if torch.device(device).type == "cpu":
        cpu_ops.load()  # linear() calls tpserve::matmul on CPU: define the ops first
    # torch.empty: real weights come from the checkpoint; random init would only cost time.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _rows(source: Any, start: int, end: int) -> torch.Tensor:
    return source[start:end]


def _cols(source: Any, start: int, end: int) -> torch.Tensor:
    return source[:, start:end]


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str = "tensor") -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch loading {what}: expected {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by output rows; each rank produces its slice of y."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPContext,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tp = tp
        self.out_sizes = [divide(s, tp.size, "output size") for s in out_sizes]
        out_local = sum(self.out_sizes)
        self.weight = _param((out_local, in_features), dtype, device)
        self.weight.weight_loader = self.load_shard
        self.bias = _param((out_local,), dtype, device) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.load_shard

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        """(local offset, source start, length) of merged part ``shard_id`` for this rank."""
        size = self.out_sizes[shard_id]
        return sum(self.out_sizes[:shard_id]), self.tp.rank * size, size

    def load_shard(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        local, start, size = self.shard_range(shard_id or 0)
        copy_into(param.data[local : local + size], _rows(source, start, start + size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when TP exceeds their count."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPContext, dtype: torch.dtype, device: torch.device) -> None:
        self.heads_local = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.kv_heads_local = divide(num_kv_heads, tp.size, "num_key_value_heads")
        else:
            divide(tp.size, num_kv_heads, "tensor-parallel size over num_key_value_heads")
            self.kv_heads_local = 1
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        q, kv = self.heads_local * head_dim, self.kv_heads_local * head_dim
        super().__init__(hidden, [q * tp.size, kv * tp.size, kv * tp.size], bias, tp, dtype, device)

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        local, start, size = super().shard_range(shard_id)
        if shard_id > 0 and self.num_kv_heads < self.tp.size:
            # Rank r serves KV head r * kv / tp: consecutive ranks share one replicated head.
            start = (self.tp.rank * self.num_kv_heads // self.tp.size) * self.head_dim
        return local, start, size


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tp = tp
        self.in_local = divide(in_features, tp.size, "input size")
        self.weight = _param((out_features, self.in_local), dtype, device)
        self.weight.weight_loader = self.load_weight
        self.bias = _param((out_features,), dtype, device) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = load_replicated

    def load_weight(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        start = self.tp.rank * self.in_local
        copy_into(param.data, _cols(source, start, start + self.in_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.comm.all_reduce(linear(x, self.weight))
        # Bias after the reduction, so it is added once rather than once per rank.
        return y if self.bias is None else y + self.bias


def load_replicated(param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
    copy_into(param.data, source[:] if not isinstance(source, torch.Tensor) else source)
