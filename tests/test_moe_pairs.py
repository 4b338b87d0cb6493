"""The ``pairs`` expert path (CUDA-graph capture of small batches) against the other two.

Under capture, a batch with at most half as many (token, slot) pairs as local experts runs
each pair's expert, gathered by a device index, instead of every local expert over every
token (``ExpertStack.forward_pairs``). It must give the eager (sorted) path's sums:

- bit for bit with a row-wise expert function, on every rank of a TP-split and of an
  expert-parallel layer (other ranks' experts weigh nothing);
- with real FP8 experts on CPU, at TP 8 and EP 8: bit for bit in bfloat16 (its matmuls do
  not depend on the row count), within rounding in float32;
- on a GPU (skipped here): captured in a CUDA graph, replayed with new routing, equal to
  eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_moe_layers import _moe, hf_config
from tpserve.layers import fp8
from tpserve.layers.experts import ExpertStack
from tpserve.layers.tp import NoComm, TPContext
from tpserve.models.config_families import MoEConfig
from tpserve.models.registry import build_model

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _routing(n: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(n)])
    return torch.rand(n, top_k, generator=g), ids


@pytest.mark.parametrize("size,ep", [(1, 1), (4, 1), (4, 4)])
def test_pairs_combine_bit_for_bit(size: int, ep: int) -> None:
    cfg = hf_config("deepseek")
    torch.manual_seed(5)
    x = torch.randn(9, 32).bfloat16()
    w, ids = _routing(9, cfg.n_routed_experts, cfg.num_experts_per_tok, 1)

    def rows_fn(e: int, rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(rows * (0.3 + e)) * (e % 3 - 1.1)

    for rank in range(size):
        stack = _moe(cfg, rank, size, ep).experts
        stack.expert_mlp = rows_fn
        stack.pair_mlp = lambda e, rows: rows_fn(int(e), rows)  # noqa: B023
        pairs, dyn = stack.forward_pairs(x, w, ids), stack.forward_sorted(x, w, ids)
        assert dyn.abs().sum() > 0 or ep > 1
        assert torch.equal(pairs, dyn), (rank, (pairs.float() - dyn.float()).abs().max())
        assert torch.equal(pairs, stack.forward_static(x, w, ids)), rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank,size,ep", [(0, 1, 1), (3, 8, 1), (5, 8, 8)])
def test_pairs_equal_sorted_with_fp8_experts(tp8_fp8_dir: Path, dtype: torch.dtype,
                                             rank: int, size: int, ep: int) -> None:
    model = build_model(tp8_fp8_dir, TPContext(rank, size, NoComm(), ep_size=ep), dtype, CPU, 64)
    moe = model.layers[1].mlp
    assert moe.experts.w13.dtype == torch.float8_e4m3fn
    torch.manual_seed(rank)
    x = (torch.randn(6, model.cfg.hidden_size) * 0.5).to(dtype)
    w, ids = moe.gate(x)
    got = moe.experts.forward_pairs(x, w, ids)
    ref = moe.experts.forward_sorted(x, w, ids)
    if dtype == torch.bfloat16:  # tpserve::matmul: a row's bits whatever rows share the call
        assert torch.equal(got, ref), (got.float() - ref.float()).abs().max()
    else:  # float32 projections go to ATen, whose rounding follows the row count
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    assert got.abs().sum() > 0 or ep > 1


def test_pairs_only_where_cheaper() -> None:
    def stack(experts: int, ep: int) -> ExpertStack:
        cfg = MoEConfig(num_experts=experts, top_k=8, intermediate_size=32, moe_layers=(0,))
        return ExpertStack(16, cfg, TPContext(0, 8, NoComm(), ep_size=ep), torch.float32,
                           torch.device("meta"))

    tp8, ep8 = stack(256, 1), stack(256, 8)  # DeepSeek-V3 at TP 8: 256 or 32 experts a rank
    assert tp8.pairs_cheaper(1 * 8) and tp8.pairs_cheaper(16 * 8)
    assert not tp8.pairs_cheaper(17 * 8)
    assert ep8.pairs_cheaper(2 * 8) and not ep8.pairs_cheaper(3 * 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_pairs_follow_new_routing() -> None:
    device = torch.device("cuda")
    cfg = MoEConfig(num_experts=32, top_k=4, intermediate_size=256, moe_layers=(0,))
    stack = ExpertStack(256, cfg, TPContext.single(), torch.bfloat16, device, (128, 128))
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for e in range(32):
            q, s = fp8.quantize(torch.randn(512, 256, device=device, generator=g) * 0.1,
                                (128, 128))
            stack.w13.data[e], stack.w13_scale_inv.data[e] = q, s
            q, s = fp8.quantize(torch.randn(256, 256, device=device, generator=g) * 0.1,
                                (128, 128))
            stack.w2.data[e], stack.w2_scale_inv.data[e] = q, s
    calls = []
    pairs = stack.forward_pairs
    stack.forward_pairs = lambda *a: calls.append(1) or pairs(*a)  # type: ignore[method-assign]
    x = torch.randn(3, 256, device=device, generator=g).bfloat16()
    w, ids = (t.to(device) for t in _routing(3, 32, 4, 0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        stack(x, w, ids)  # warm-up, eager (sorted)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = stack(x, w, ids)
    assert calls, "a 12-pair batch over 32 local experts should capture the pairs path"
    for seed in (0, 1, 2):
        new_w, new_ids = (t.to(device) for t in _routing(3, 32, 4, seed))
        new_x = torch.randn(3, 256, device=device, generator=g).bfloat16()
        x.copy_(new_x), w.copy_(new_w), ids.copy_(new_ids)
        graph.replay()
        ref = stack.forward_sorted(new_x, new_w, new_ids)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-3)
