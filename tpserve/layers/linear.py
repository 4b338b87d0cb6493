"""Column- and row-parallel linear layers with per-parameter weight loaders.

Each parameter carries a ``weight_loader(param, source, shard_id)`` that copies just this
rank's slice out of ``source`` (a safetensors slice or a tensor), so the loader never
materialises a full weight on a rank.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.layers import cpu_ops
from tpserve.layers.tp import TPContext, divide

# Rows up to which a CPU projection goes through tpserve::matmul (gemm.c) rather than ATen.
# ATen's bf16 matmul is a oneDNN gemm whose speed depends on the CPU's matrix ISA, so the
# crossover does too (launch/bench_gemm.py --threads 2, quiet 2-vCPU Xeon, ms per decode
# step's projections, native vs F.linear; ONEDNN_MAX_CPU_ISA caps oneDNN to mimic other CPUs):
#   AMX (oneDNN default here), hidden 512 x 8 layers: M=1 2.3 vs 4.2, 4: 3.1 vs 5.7,
#     6: 6.9 vs 7.9, 8: 6.1 vs 5.5, 16: 10.1 vs 6.2; hidden 2048 x 2: 4: 15.5 vs 15.1, 8: 19.6
#     vs 13.3 -> native up to 4 rows would be fastest, but we keep 8: a batch-1 verify of the
#     default 8-token tree then runs the same kernel as plain decode, so its logits are bit-equal
#     to plain decode's and greedy speculation stays token-identical (a 0.7-0.9x cost at 5-8
#     rows, where only verify and small batches land). Above 8 rows the AMX gemm is several
#     times faster, so there a prompt's bits depend on how it was batched (below).
#   AVX512-BF16 without AMX: 16 rows 10.3 vs 11.9 and 32.9 vs 32.4, 64 rows 34 vs 29 and 113
#     vs 95; on a 2-vCPU AVX-512 EPYC (Zen 4 class, 256 KB chunks) ATen/native 1.00-1.16 up to
#     16 rows, 0.71-0.81 at 64-512 -> native at any M all the same: every output's bits then
#     stay independent of how the tokens were batched (a prefix hit's recomputed tail, a
#     chunked or preempted prompt, decode rows beside a prompt chunk), where with ATen above
#     16 rows a repeated 128-token prompt's greedy output on the bench model changed at its
#     115th token on a hit. The cost is small where attention and the rest share the step:
#     that model's offline 8192-token prefill 1050 vs 1080 tok/s.
#   AVX2 (Zen 3-class): native 4-5.5x faster at every M from 8 to 64 (h512: 64 rows 29 vs 159
#     ms), and oneDNN's AVX2 bf16 gemm stays ~9 GFLOP/s at any size -> native at any M.
AMX_ROWS = 8


def native_matmul_rows() -> int:
    """Largest row count sent to ``tpserve::matmul`` on this CPU (see the table above)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    capped = isa != "ALL" and isa != "DEFAULT"
    if torch.cpu._is_amx_tile_supported() and (not capped or "AMX" in isa):
        return AMX_ROWS
    return sys.maxsize


# Resolved once at import: dynamo cannot trace torch.cpu's ISA probes inside compiled decode.
NATIVE_MATMUL_ROWS = native_matmul_rows()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear``, but CPU projections of up to ``NATIVE_MATMUL_ROWS`` rows (decode,
    speculative verify, mixed decode + prefill steps) go through ``tpserve::matmul``
    (``cpu_ops``).

    Those steps do little but stream the weights, and ATen's CPU matmul (a oneDNN gemm) streams
    bf16 weights at a fraction of our kernel's rate, which splits the weight rows across its
    own threads and reads each weight once per block of rows. The op is opaque to inductor, so
    compiled decode rounds exactly like eager; and each output's arithmetic does not depend on
    the other rows in the call or the thread count, so a token's logits are the same in plain
    decode and in a verify batch.
    """
    if x.dim() != 2 or x.shape[0] > NATIVE_MATMUL_ROWS or not x.is_cpu:
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
