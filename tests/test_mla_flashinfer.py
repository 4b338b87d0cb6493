"""MLA decode through FlashInfer's paged MLA kernel (``layers/mla_flashinfer``).

On CPU, against tests/fake_flashinfer.py's model of ``flashinfer.mla.BatchMLAPagedAttentionWrapper``
(the glue: page layout, the strided ckv / kpe views of our cache, key counts, graph-mode
buffers): eager decode equals the ``mla`` backend over fragmented pages and mixed lengths;
other steps go to the ``mla`` backend; under CUDA graphs (stand-in graphs that re-run the
forward on the static inputs) a replayed step reads only what ``graph_replan`` put in the
wrapper's buffers, at one key span; the start-up agreement check passes on a faithful kernel
and refuses a wrong one. On a GPU (marked ``gpu``), the real library against the ``mla``
backend, and the choice ``auto`` makes there.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import numpy as np
import pytest
import torch

from tests import fake_flashinfer, stand_in_graphs
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.graphs import CudaGraphExecutor, GraphConfig
from tpserve.engine.static_forward import StaticForward
from tpserve.layers.attention.metadata import AttentionMetadata, build_metadata
from tpserve.layers.mla_attention import BoundMLA, MLABackend
from tpserve.layers.mla_flashinfer import (
    FlashInferBoundMLA,
    FlashInferMLA,
    _disagreement,
    choose_mla_backend,
    mla_flashinfer_agrees,
)

CPU = torch.device("cpu")
C, R, HEADS, PAGE, POOL = 32, 8, 4, 4, 40  # a small latent: the fake takes any width
SCALE = 0.2


def _backend(device: torch.device = CPU, dtype: torch.dtype = torch.float32,
             fi: Any = None, c: int = C, r: int = R, heads: int = HEADS) -> FlashInferMLA:
    return FlashInferMLA(c + r, c, heads, SCALE, dtype, device,
                         flashinfer=fi or fake_flashinfer.module())


def _layout(seed: int, kv_lens: list[int], q_lens: list[int] | None = None,
            device: torch.device = CPU) -> AttentionMetadata:
    """Fragmented, non-overlapping pages (page 0 stays the dummy page), one row per request."""
    rng = np.random.default_rng(seed)
    need = [-(-k // PAGE) for k in kv_lens]
    pages = rng.permutation(np.arange(1, POOL))[: sum(need)]
    table = np.zeros((len(kv_lens), max(need)), dtype=np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = pages[at: at + n]
        at += n
    q = np.array(q_lens or [1] * len(kv_lens), dtype=np.int32)
    return build_metadata(table, q, np.array(kv_lens, dtype=np.int32), PAGE, device)


def _inputs(seed: int, rows: int, dtype: torch.dtype = torch.float32, c: int = C, r: int = R,
            heads: int = HEADS, device: torch.device = CPU) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(POOL * PAGE, 1, c + r, generator=g)
    parts = (cache, torch.randn(rows, heads, c, generator=g), torch.randn(rows, heads, r, generator=g),
             torch.randn(rows, c + r, generator=g))
    return tuple(t.to(device, dtype) for t in parts)


def _both(backend: FlashInferMLA, meta: AttentionMetadata, seed: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cache, q_latent, q_pe, latent = _inputs(seed, meta.num_rows)
    mine, theirs = cache.clone(), cache.clone()
    bound = backend.bind(meta)
    assert isinstance(bound, FlashInferBoundMLA)
    got = bound.absorbed(q_latent, q_pe, latent, mine, SCALE)
    ref = backend.fallback.bind(meta).absorbed(q_latent, q_pe, latent, theirs, SCALE)
    return got, ref, mine, theirs


@pytest.mark.parametrize("kv_lens", [[1], [5, 17, 4, 9], [40, 2, 33]])
def test_decode_equals_the_mla_backend(kv_lens: list[int]) -> None:
    got, ref, mine, theirs = _both(_backend(), _layout(len(kv_lens), kv_lens), 7)
    assert got.shape == (len(kv_lens), HEADS, C)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine, theirs)  # the step's latents written to the same slots


def test_prefill_and_mixed_steps_run_the_kernel_causally_in_both_forms() -> None:
    """A prompt chunk beside decode rows: the kernel (causal) gives the mla backend's output,
    for the absorbed form and for ``expanded`` (kv_b_proj's halves applied around it)."""
    backend = _backend()
    meta = _layout(1, [6, 9, 13], q_lens=[3, 1, 5])
    got, ref, mine, theirs = _both(backend, meta, 3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine, theirs)
    g = torch.Generator().manual_seed(4)
    nope, v = 6, 5
    w_uk, w_uv = torch.randn(HEADS, nope, C, generator=g), torch.randn(HEADS, v, C, generator=g)
    cache, _, q_pe, latent = _inputs(5, meta.num_rows)
    q_nope = torch.randn(meta.num_rows, HEADS, nope, generator=g)
    got = backend.bind(meta).expanded(q_nope, q_pe, latent, cache.clone(), SCALE, w_uk, w_uv)
    ref = backend.fallback.bind(meta).expanded(q_nope, q_pe, latent, cache.clone(), SCALE,
                                               w_uk, w_uv)
    assert got.shape == ref.shape == (meta.num_rows, HEADS, v)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def _verify_step(seed: int, kv_lens: list[int], queries: int, chain: bool,
                 device: torch.device = CPU) -> AttentionMetadata:
    """A verify batch of ``queries`` nodes per request: a chain's lower-triangular mask, or a
    tree's (node 2 a second child of the root)."""
    base = _layout(seed, kv_lens)
    q = np.full(len(kv_lens), queries, dtype=np.int32)
    mask = torch.tril(torch.ones(queries, queries, dtype=torch.bool))
    if not chain:
        mask[2, 1] = False
    return build_metadata(base.host.page_table, q, base.host.kv_lens, PAGE, device,
                          mask_start=base.host.kv_lens - q,
                          custom_mask=mask.expand(len(kv_lens), -1, -1), mask_is_causal=chain)


def test_a_chain_verify_runs_the_kernel_causally_and_a_tree_keeps_the_mla_backend() -> None:
    """``--speculative-eagle-topk 1`` (the default) verifies a chain, whose mask is causal: the
    kernel's causal output equals the mla backend's under that mask. A tree's mask is not."""
    backend = _backend()
    got, ref, mine, theirs = _both(backend, _verify_step(2, [9, 23, 5], 4, chain=True), 6)
    assert got.shape == (12, HEADS, C)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine, theirs)
    assert backend._eager.args["causal"] is True
    assert isinstance(backend.bind(_verify_step(2, [9, 23, 5], 4, chain=False)), BoundMLA)


def test_only_a_mask_over_the_query_block_may_be_called_causal() -> None:
    base = _layout(1, [6, 9], q_lens=[2, 2])
    q = np.array([2, 2], dtype=np.int32)
    with pytest.raises(ValueError, match="mask_is_causal"):
        build_metadata(base.host.page_table, q, base.host.kv_lens, PAGE, CPU,
                       mask_start=base.host.kv_lens - 3,
                       custom_mask=torch.ones(2, 2, 3, dtype=torch.bool), mask_is_causal=True)
    with pytest.raises(ValueError, match="mask_is_causal"):
        build_metadata(base.host.page_table, q, base.host.kv_lens, PAGE, CPU, mask_is_causal=True)


def test_the_verify_layout_is_a_chain_only_for_topk_1() -> None:
    from tpserve.spec.tree import tree_metadata

    table = np.arange(1, 7, dtype=np.int32).reshape(2, 3)
    cached = np.array([3, 5])
    for chain in (True, False):
        meta = tree_metadata(table, cached, 4, cached, 4, PAGE, CPU, chain=chain)
        assert meta.mask_is_causal is chain


def test_the_eager_plan_follows_each_step() -> None:
    backend = _backend()
    for seed, lens in enumerate([[3, 30], [25], [8, 8, 8]]):
        got, ref, _, _ = _both(backend, _layout(seed, lens), seed)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_decode_graphs_replay_over_the_pages_each_step_uses(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    stand_in_graphs.install(monkeypatch)
    backend = _backend()
    cache = torch.zeros(POOL * PAGE, 1, C + R)
    tables = [torch.zeros(64, HEADS, C), torch.zeros(64, HEADS, R), torch.zeros(64, C + R)]

    def fn(fb: ForwardBatch, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        q_latent, q_pe, latent = (t[fb.input_ids] for t in tables)
        return (backend.bind(fb.attn).absorbed(q_latent, q_pe, latent, cache, SCALE),)

    forward = StaticForward("decode", 1, fn, backends=lambda: (backend,))
    cfg = GraphConfig((2, 4), 48, PAGE, {}, (16, 32, 48))
    executor = CudaGraphExecutor(cfg, CPU, None)
    with torch.inference_mode():
        executor.capture(forward)
        assert executor.spans["decode"] == {2: (48,), 4: (48,)}  # reads pages in place
        for seed, lens in enumerate([[5, 40, 3], [12, 1], [47, 30, 2, 9]]):
            meta = _layout(seed, lens)
            start, q_latent, q_pe, latent = _inputs(seed, len(lens))
            for table, src in zip(tables, (q_latent, q_pe, latent), strict=True):
                table[1: len(lens) + 1] = src
            cache.copy_(start)
            ids = torch.arange(1, len(lens) + 1)
            out = executor.run("decode", ForwardBatch(ids, ids.clone(), meta, 1), {})
            assert out is not None
            ref = backend.fallback.bind(meta).absorbed(q_latent, q_pe, latent, start.clone(),
                                                       SCALE)
            torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)


def test_the_agreement_check_passes_a_faithful_kernel_and_refuses_a_wrong_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    width = dict(c=512, r=64, heads=2)
    assert _disagreement(_backend(**width), CPU) is None

    class Wrong(fake_flashinfer.BatchMLAPagedAttentionWrapper):
        def run(self, *args: Any, **kw: Any) -> torch.Tensor:
            return super().run(*args, **kw) * 1.1

    broken = fake_flashinfer.module()
    broken.mla.BatchMLAPagedAttentionWrapper = Wrong
    assert "differs from the mla backend" in str(_disagreement(_backend(fi=broken, **width), CPU))

    class WrongOnVerifies(fake_flashinfer.BatchMLAPagedAttentionWrapper):
        def run(self, *args: Any, **kw: Any) -> torch.Tensor:
            out = super().run(*args, **kw)
            return out * 1.1 if self.layout[0] == [0, 4, 8] else out  # a chain's rows only

    broken.mla.BatchMLAPagedAttentionWrapper = WrongOnVerifies
    reason = str(_disagreement(_backend(fi=broken, **width), CPU))
    assert "differs from the mla backend" in reason and "[4, 4]" in reason


def test_cpu_keeps_the_mla_backend() -> None:
    chosen = choose_mla_backend("auto", 576, 512, 64, 2, SCALE, torch.bfloat16, CPU)
    assert isinstance(chosen, MLABackend)


def test_an_unexpected_library_leaves_the_mla_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel's set-up or run raises (another FlashInfer API), the check says why
    instead of the server failing."""
    broken = fake_flashinfer.module()
    broken.mla.BatchMLAPagedAttentionWrapper = None  # calling it raises TypeError
    monkeypatch.setitem(sys.modules, "flashinfer", broken)
    mla_flashinfer_agrees.cache_clear()
    try:
        assert "TypeError" in str(mla_flashinfer_agrees(CPU, 2, torch.float32))
    finally:
        mla_flashinfer_agrees.cache_clear()


# ---- the real library (GPU) ------------------------------------------------------------------

def _real_flashinfer() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _real_flashinfer(), reason="needs CUDA and flashinfer-python")
def test_gpu_kernel_matches_the_mla_backend_and_auto_chooses_it() -> None:
    cuda = torch.device("cuda")
    assert mla_flashinfer_agrees(cuda, 16, torch.bfloat16) is None
    chosen = choose_mla_backend("auto", 576, 512, 64, 16, SCALE, torch.bfloat16, cuda)
    assert isinstance(chosen, FlashInferMLA)
    for seed, lens in enumerate([[1, 130, 7], [300, 16, 65, 2, 90]]):
        meta = _layout(seed, [min(k, POOL * PAGE // len(lens) - PAGE) for k in lens],
                       device=cuda)
        cache, q_latent, q_pe, latent = _inputs(seed, meta.num_rows, torch.bfloat16, 512, 64,
                                                16, cuda)
        got = chosen.bind(meta).absorbed(q_latent, q_pe, latent, cache.clone(), SCALE)
        ref = chosen.fallback.bind(meta).absorbed(q_latent, q_pe, latent, cache.clone(), SCALE)
        assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not _real_flashinfer(), reason="needs CUDA and flashinfer-python")
def test_gpu_chain_verify_matches_the_mla_backend_under_its_mask() -> None:
    """The real kernel, causal over a chain's verify rows (5 per request), against the mla
    backend reading the chain's mask."""
    cuda = torch.device("cuda")
    chosen = choose_mla_backend("auto", 576, 512, 64, 16, SCALE, torch.bfloat16, cuda)
    assert isinstance(chosen, FlashInferMLA)
    meta = _verify_step(3, [37, 9, 90], 5, chain=True, device=cuda)  # 36 of the 39 pages
    cache, q_latent, q_pe, latent = _inputs(3, meta.num_rows, torch.bfloat16, 512, 64, 16, cuda)
    bound = chosen.bind(meta)
    assert isinstance(bound, FlashInferBoundMLA)
    got = bound.absorbed(q_latent, q_pe, latent, cache.clone(), SCALE)
    ref = chosen.fallback.bind(meta).absorbed(q_latent, q_pe, latent, cache.clone(), SCALE)
    assert (got.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not _real_flashinfer(), reason="needs CUDA and flashinfer-python")
def test_gpu_deepseek_decodes_through_the_kernel_eagerly_and_in_graphs(tmp_path: Any) -> None:
    """A tiny DeepSeek-V3 with the real latent (512 + 64), bf16: ``auto`` picks the kernel,
    decode graphs take one key span, and graphs give eager's greedy tokens."""
    from tests.moe_checkpoints import make_moe_checkpoint
    from tests.spec_helpers import args_for
    from tpserve.engine.sampling_params import SamplingParams
    from tpserve.offline import OfflineEngine

    target = make_moe_checkpoint(tmp_path / "ds", "deepseek", kv_lora_rank=512,
                                 qk_rope_head_dim=64)
    gpu = dict(device="cuda", allreduce="nccl", max_total_tokens=8192, cuda_graph_bs=(1, 2, 4),
               dtype="bfloat16")
    prompts = [[1] + [(5 * i + 3 * j) % 90 + 3 for j in range(2 + 3 * i)] for i in range(3)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs_on in (False, True):
        engine = OfflineEngine(args_for(target, **gpu, disable_cuda_graph=not graphs_on))
        assert engine.built.runner.model.attention.name == "flashinfer_mla"
        if graphs_on:
            assert engine.built.runner.graph_info["sets"]["decode"]["key_spans"] == [
                engine.built.runner.graph_info["max_keys"]]
        outs[graphs_on] = [o.output_ids for o in engine.generate(prompts, params)]
        engine.close()
    assert outs[True] == outs[False]


def _choose_on_rank(rank: int, world: int) -> str | None:
    """One rank of a gloo world: rank 1 finds the kernel unusable; both must learn it."""
    import tpserve.layers.mla_flashinfer as mf

    return mf._refused_elsewhere(rank != 1)


def test_ranks_agree_on_the_mla_backend() -> None:
    from tests.harness import spawn

    assert spawn(2, _choose_on_rank) == ["another rank cannot run it"] * 2


def test_steps_past_the_kernels_limits_take_the_mla_backend(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    import tpserve.layers.mla_flashinfer as mf

    backend = _backend()
    monkeypatch.setattr(mf, "MAX_WORKS", 2)  # work tiles: ceil(q_len * heads / 64) a request
    assert isinstance(backend.bind(_layout(1, [5, 9])), FlashInferBoundMLA)  # 1 + 1
    assert isinstance(backend.bind(_layout(1, [50, 9], q_lens=[40, 1])), BoundMLA)  # 3 + 1
    monkeypatch.setattr(mf, "MAX_WORKS", 16384)
    monkeypatch.setattr(mf, "INDEX_LIMIT", POOL * PAGE * (C + R))  # this cache is too large
    meta = _layout(2, [7, 20])
    bound = backend.bind(meta)
    assert isinstance(bound, FlashInferBoundMLA)
    bound.wrapper.run = None  # the kernel must not be called
    cache, q_latent, q_pe, latent = _inputs(2, 2)
    got = bound.absorbed(q_latent, q_pe, latent, cache.clone(), SCALE)
    ref = backend.fallback.bind(meta).absorbed(q_latent, q_pe, latent, cache.clone(), SCALE)
    assert torch.equal(got, ref)


def test_a_plan_whose_launch_changes_under_a_graph_is_refused() -> None:
    backend = _backend()
    static = _layout(0, [40, 40])  # as wide as the replans need
    backend.graph_capture(static)
    wrapper = backend._static[id(static)][1]
    backend.graph_replan(static, _layout(1, [30, 4]))  # the same launch: fine
    plan = wrapper.plan

    def shifted(*args: Any, **kw: Any) -> None:
        plan(*args, **kw)
        wrapper._plan_info = [99]

    wrapper.plan = shifted
    with pytest.raises(RuntimeError, match="launch parameters under a CUDA graph"):
        backend.graph_replan(static, _layout(2, [12, 4]))


def test_a_layout_dependent_plan_keeps_the_graph_on_the_mla_backend() -> None:
    class Shifting(fake_flashinfer.BatchMLAPagedAttentionWrapper):
        def plan(self, *args: Any, **kw: Any) -> None:
            super().plan(*args, **kw)
            self._plan_info = [int(args[3].sum())]  # depends on the key counts

    fi = fake_flashinfer.module()
    fi.mla.BatchMLAPagedAttentionWrapper = Shifting
    backend = _backend(fi=fi)
    static = _layout(0, [3, 1])  # one page a row; the longest rows would fill it
    backend.graph_capture(static)
    assert backend._static[id(static)][1] is None
    assert isinstance(backend.bind(static), BoundMLA)
