"""A rank's routed experts stacked in 3-D weights, their loaders, and the expert compute.

Weights: ``w13`` [E_local, 2 * I_local, H] (gate rows then up rows) and ``w2``
[E_local, H, I_local], in the model dtype or FP8 with block scales (``w13_scale_inv``,
``w2_scale_inv``). Checkpoints store one tensor per expert and projection; the loader's
shard id is ``3 * expert + kind`` (0 gate, 1 up, 2 down), and experts that live on another
rank (expert parallelism) are skipped without being read.

Three compute paths, same result:

- ``sorted`` (eager): (token, slot) pairs are sorted by expert id, so each expert's tokens are
  one contiguous slice; each local expert with tokens runs one matmul over its slice, and the
  weighted results are added back per token with one ``index_add_``. Needs the per-expert
  counts on the host (one sync), so it cannot be captured or traced;
- ``static`` (CUDA-graph capture, torch.compile): every local expert runs over every token and
  is weighted by the dense routing matrix (zero where not chosen). No data-dependent shapes,
  but it reads every local expert's weights each step;
- ``pairs`` (CUDA-graph capture of small batches, where the (token, slot) pairs number at most
  half the local experts): each pair gathers its expert's weights by a device index
  (``index_select``, no host sync) and runs that expert on its token's row. At TP 8 with
  DeepSeek-V3's 256 experts, a batch-1 decode step otherwise ran all 256 local experts in
  each of 58 layers, ~27 small kernels each (~400K graph nodes a step); the pairs are 8 a
  layer. The same float32 sum per token in ascending expert order as the other paths; with
  FP8 experts on the block GEMM, whose rows are padded to 16, also the same matmul shape as
  the eager path for an expert with up to 16 tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tpserve.errors import ConfigError
from tpserve.layers import fused
from tpserve.layers.fp8 import FP8, Block, fp8_linear
from tpserve.layers.linear import _param, copy_into, linear
from tpserve.layers.quant import check_aligned, require_fp8
from tpserve.layers.tp import TPContext, divide
from tpserve.models.config_families import MoEConfig


def expert_placement(num_experts: int, tp: TPContext) -> tuple[int, int]:
    """(first expert, experts) held by this rank: all of them unless expert-parallel."""
    if tp.ep_size == 1:
        return 0, num_experts
    if tp.ep_size != tp.size:
        raise ConfigError(f"--ep-size {tp.ep_size} must equal the tensor-parallel size "
                          f"{tp.size} (or be 1)", flag="--ep-size")
    if num_experts % tp.ep_size:
        raise ConfigError(f"{num_experts} experts cannot be placed evenly on --ep-size "
                          f"{tp.ep_size} ranks", flag="--ep-size")
    per_rank = num_experts // tp.ep_size
    return tp.rank * per_rank, per_rank


class ExpertStack(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, block: Block | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.first, self.local_experts = expert_placement(cfg.num_experts, tp)
        split = tp.ep_size == 1 and tp.size > 1
        self.inter_local = divide(cfg.intermediate_size, tp.size if split else 1,
                                  "moe_intermediate_size")
        self.split_start = tp.rank * self.inter_local if split else 0
        self.block = block
        e, i = self.local_experts, self.inter_local
        wdtype = FP8 if block else dtype
        self.w13 = _param((e, 2 * i, hidden), wdtype, device)
        self.w2 = _param((e, hidden, i), wdtype, device)
        self.w13_scale_inv = self.w2_scale_inv = None
        if block is not None:
            check_aligned(self.split_start, i, -1, block[0], "experts (gate/up rows)")
            check_aligned(self.split_start, i, cfg.intermediate_size, block[1],
                          "experts (down columns)")
            self.w13_scale_inv = _param((e, 2 * i // block[0], math.ceil(hidden / block[1])),
                                        torch.float32, device)
            self.w2_scale_inv = _param((e, math.ceil(hidden / block[0]),
                                        math.ceil(i / block[1])), torch.float32, device)
        for p in (self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv):
            if p is not None:
                p.weight_loader = self.load_expert

    def load_expert(self, param: nn.Parameter, source: Any, shard_id: int | None = None) -> None:
        expert, kind = divmod(int(shard_id or 0), 3)
        local = expert - self.first
        if not 0 <= local < self.local_experts:
            return  # another rank's expert
        is_scale = param is self.w13_scale_inv or param is self.w2_scale_inv
        if not is_scale and self.block is not None:
            require_fp8(source, f"expert {expert}")
        step = 1 if not is_scale else self.block[0] if kind < 2 else self.block[1]
        start, size = self.split_start // step, math.ceil(self.inter_local / step)
        what = f"expert {expert} {'gate up down'.split()[kind]}"
        if kind < 2:
            copy_into(param.data[local, kind * size: (kind + 1) * size],
                      source[start: start + size], what)
        else:
            copy_into(param.data[local], source[:, start: start + size], what)

    def _matmul(self, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        w = getattr(self, which)[e]
        if self.block is None:
            return linear(x, w)
        return fp8_linear(x, w, getattr(self, which + "_scale_inv")[e], self.block)

    def expert_mlp(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(fused.silu_mul(self._matmul(x, "w13", e)), "w2", e)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights/ids [N, top_k] -> this rank's partial output [N, H]."""
        if torch.compiler.is_compiling():
            return self.forward_static(x, weights, ids)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            if self.pairs_cheaper(ids.numel()):
                return self.forward_pairs(x, weights, ids)
            return self.forward_static(x, weights, ids)
        return self.forward_sorted(x, weights, ids)

    def pairs_cheaper(self, pairs: int) -> bool:
        """Whether running each (token, slot) pair's expert beats running every local expert:
        a pair costs about what an expert does (a few more kernels: the two gathers) and
        copies its expert's weights once more, so only at up to half as many pairs."""
        return 2 * pairs <= self.local_experts

    def forward_sorted(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                       ) -> torch.Tensor:
        n, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rank = slot_rank(ids).reshape(-1)
        local = (flat >= self.first) & (flat < self.first + self.local_experts)
        # One host sync for both: pairs per expert, and local pairs per slot rank.
        counts = torch.cat([torch.bincount(flat, minlength=self.num_experts),
                            torch.bincount(rank, weights=local.float(), minlength=top_k).long()]
                           ).tolist()
        rank_counts = counts[self.num_experts:]
        lo = sum(counts[: self.first])
        local_counts = counts[self.first: self.first + self.local_experts]
        if sum(local_counts) == 0:
            return torch.zeros_like(x)
        pairs = order[lo: lo + sum(local_counts)]
        tokens = pairs // top_k
        xs = x.index_select(0, tokens)
        ys = torch.empty_like(xs)
        offset = 0
        for e, count in enumerate(local_counts):
            if count:
                ys[offset: offset + count] = self.expert_mlp(e, xs[offset: offset + count])
                offset += count
        # Add each token's experts in ascending expert order, in float32, one slot rank per
        # index_add_ (no token twice in one call): the same sums, bit for bit, as
        # forward_static's loop over experts, and no atomics racing on CUDA.
        by_rank = torch.argsort(rank[pairs] * n + tokens)
        pair_weights = weights.reshape(-1)[pairs].float().unsqueeze(1)
        acc = x.new_zeros(x.shape, dtype=torch.float32)
        start = 0
        for count in rank_counts:
            sel = by_rank[start: start + count]
            start += count
            acc.index_add_(0, tokens[sel], ys[sel].float() * pair_weights[sel])
        return acc.to(x.dtype)

    def forward_static(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                       ) -> torch.Tensor:
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=torch.float32,
                            device=x.device).scatter_(1, ids, weights.float())
        local = dense[:, self.first: self.first + self.local_experts]
        acc = x.new_zeros(x.shape, dtype=torch.float32)
        for e in range(self.local_experts):
            acc = acc + self.expert_mlp(e, x).float() * local[:, e: e + 1]
        return acc.to(x.dtype)

    def pair_mlp(self, e: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``expert_mlp`` for the local expert at the one-element device index ``e``."""
        return self._pair_matmul(fused.silu_mul(self._pair_matmul(x, "w13", e)), "w2", e)

    def _pair_matmul(self, x: torch.Tensor, which: str, e: torch.Tensor) -> torch.Tensor:
        w = _take(getattr(self, which), e)
        if self.block is None:
            return linear(x, w)
        return fp8_linear(x, w, _take(getattr(self, which + "_scale_inv"), e), self.block)

    def forward_pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                      ) -> torch.Tensor:
        """Capturable like ``forward_static``, reading only the chosen experts: every
        (token, slot) pair runs its expert on its token's row (another rank's expert: weight
        zero, its index clamped to a local one). Each token's slots are taken in ascending
        expert order and added in float32, as both other paths do, so the sums match theirs
        bit for bit wherever the expert's rows do."""
        n, top_k = ids.shape
        experts, order = ids.sort(dim=1)
        local = experts - self.first
        inside = (local >= 0) & (local < self.local_experts)
        pair_weights = weights.gather(1, order).float()
        local = local.clamp(0, self.local_experts - 1)
        acc = x.new_zeros(x.shape, dtype=torch.float32)
        for j in range(top_k):
            ys = torch.cat([self.pair_mlp(local[t, j: j + 1], x[t: t + 1]) for t in range(n)])
            acc = acc + torch.where(inside[:, j: j + 1], ys.float() * pair_weights[:, j: j + 1],
                                    0.0)
        return acc.to(x.dtype)


def _take(stack: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``stack[e]`` for a one-element index tensor ``e``, without reading ``e`` on the host
    (FP8 through its bytes: index kernels need not cover float8 types)."""
    if stack.dtype == FP8:
        return stack.view(torch.uint8).index_select(0, e)[0].view(FP8)
    return stack.index_select(0, e)[0]


def slot_rank(ids: torch.Tensor) -> torch.Tensor:
    """[N, top_k] expert ids -> each slot's place among its token's experts by ascending id."""
    return (ids.unsqueeze(1) < ids.unsqueeze(2)).sum(-1)
