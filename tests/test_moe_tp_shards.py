"""FP8 DeepSeek-V3 sharded at TP 8 (and EP 8) and run at TP 4 over gloo, against TP 1.

The other FP8 tests use a block that only divides at TP 2. Here a tiny DeepSeek-V3 with 8
heads and an (8, 8) block splits on block boundaries at TP 2, 4 and 8, as DeepSeek-V3's
128 x 128 blocks do at TP 8 (``moe_checkpoints.make_tp8_fp8_checkpoint``), so every sharding
rule is exercised at the TP size these models are served at:

- each simulated rank's FP8 weights, dequantised with the scale rows / columns it loaded,
  are exactly its slice of the TP 1 model's (q_b_proj rows by heads, kv_b_proj's absorbed
  halves by heads, o_proj columns, replicated kv_a_proj_with_mqa, dense and shared gate/up
  rows and down columns, each routed expert's gate/up rows and down columns, or whole
  experts under EP);
- the per-rank partial sums of every MLP / MoE layer add up to the TP 1 layer;
- the whole model at TP 4 (experts split and placed) gives TP 1's prefill logits on every
  rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import build, spawn
from tests.test_model_vs_hf import assert_close, prefill_logits
from tpserve.layers.fp8 import dequantize
from tpserve.layers.tp import NoComm, TPContext
from tpserve.models.registry import build_model

PROMPT = [5, 7, 9, 11, 13, 3, 4, 30, 31]
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def full(tp8_fp8_dir: Path):  # type: ignore[no-untyped-def]
    return build_model(tp8_fp8_dir, TPContext.single(), torch.float32, CPU, 64)


def _deq(layer) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return dequantize(layer.weight.data, layer.weight_scale_inv.data, layer.block)


def _gate_up(w: torch.Tensor, start: int, size: int, total: int) -> torch.Tensor:
    """Rows of a fused [gate; up] weight of ``total`` rows per part that one rank holds."""
    return torch.cat([w[start: start + size], w[total + start: total + start + size]])


def _check_rank(model, full, rank: int) -> None:  # type: ignore[no-untyped-def]
    for mine, ref in zip(model.layers, full.layers):
        a, b = mine.self_attn, ref.self_attn
        h = a.heads
        heads = slice(rank * h, (rank + 1) * h)
        q_b = _deq(b.q_b_proj)
        assert torch.equal(_deq(a.q_b_proj),
                           q_b.view(b.heads, -1, q_b.shape[1])[heads].reshape(-1, q_b.shape[1]))
        assert torch.equal(a.w_uk, b.w_uk[heads]) and torch.equal(a.w_uv, b.w_uv[heads])
        width = a.o_proj.weight.shape[1]
        assert torch.equal(_deq(a.o_proj), _deq(b.o_proj)[:, rank * width: (rank + 1) * width])
        assert torch.equal(_deq(a.kv_a_proj_with_mqa), _deq(b.kv_a_proj_with_mqa))
        assert torch.equal(_deq(a.q_a_proj), _deq(b.q_a_proj))
        mlps = [(mine.mlp, ref.mlp)]
        if hasattr(mine.mlp, "experts"):
            mlps = [(mine.mlp.shared_experts, ref.mlp.shared_experts)]
            ex, fx = mine.mlp.experts, ref.mlp.experts
            i, start = ex.inter_local, ex.split_start
            for e in range(ex.local_experts):
                g = ex.first + e
                w13 = dequantize(ex.w13.data[e], ex.w13_scale_inv.data[e], ex.block)
                f13 = dequantize(fx.w13.data[g], fx.w13_scale_inv.data[g], fx.block)
                assert torch.equal(w13, _gate_up(f13, start, i, fx.inter_local)), (rank, e)
                w2 = dequantize(ex.w2.data[e], ex.w2_scale_inv.data[e], ex.block)
                f2 = dequantize(fx.w2.data[g], fx.w2_scale_inv.data[g], fx.block)
                assert torch.equal(w2, f2[:, start: start + i]), (rank, e)
        for m, f in mlps:
            i = m.inter_local
            assert torch.equal(_deq(m.gate_up_proj),
                               _gate_up(_deq(f.gate_up_proj), rank * i, i, f.inter_local))
            assert torch.equal(_deq(m.down_proj), _deq(f.down_proj)[:, rank * i: (rank + 1) * i])


@pytest.mark.parametrize("size,ep", [(8, 1), (8, 8), (4, 1), (4, 4)])
def test_rank_slices_and_partial_sums(tp8_fp8_dir: Path, full,  # type: ignore[no-untyped-def]
                                      size: int, ep: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(13, full.cfg.hidden_size)
    totals = [torch.zeros_like(x) for _ in full.layers]
    for rank in range(size):
        model = build_model(tp8_fp8_dir, TPContext(rank, size, NoComm(), ep_size=ep),
                            torch.float32, CPU, 64)
        stack = model.layers[1].mlp.experts
        per_rank = full.cfg.moe.num_experts // size
        assert (stack.first, stack.local_experts) == ((0, 16) if ep == 1 else
                                                      (rank * per_rank, per_rank))
        _check_rank(model, full, rank)
        for i, layer in enumerate(model.layers):
            totals[i] += layer.mlp(x)  # NoComm: the rank's partial sum, what the allreduce adds
    for i, layer in enumerate(full.layers):
        torch.testing.assert_close(totals[i], layer.mlp(x), rtol=1e-5, atol=1e-6,
                                   msg=f"layer {i}")


def _rank_logits(rank: int, world: int, path: Path) -> dict[int, torch.Tensor]:
    out = {}
    for ep in (1, world):
        built = build(path, allreduce="gloo", ep_size=ep)
        out[ep] = prefill_logits(built.runner, PROMPT)  # every rank: paired allreduces
        if built.channel is not None:
            built.channel.close()
    return out


def test_tp4_logits_match_tp1(tp8_fp8_dir: Path) -> None:
    ref = prefill_logits(build(tp8_fp8_dir).runner, PROMPT)
    results = spawn(4, _rank_logits, tp8_fp8_dir)
    for ep in (1, 4):
        assert_close(results[0][ep], ref, f"FP8 TP 4 ep {ep}")
        for rank in range(1, 4):
            assert torch.equal(results[rank][ep], results[0][ep]), f"ep {ep}: ranks disagree"
