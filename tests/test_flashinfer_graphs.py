"""FlashInfer under CUDA graphs, on CPU: the executor's capture/replan/replay plumbing against
tests/fake_flashinfer.py's model of FlashInfer's CUDA-graph decode wrapper.

A replay here re-runs the captured forward's Python on the graph's static inputs
(tests/stand_in_graphs.py). Outputs are checked against the float64 reference
and the eager ``torch`` backend, over contexts of different lengths in one bucket, all longer
than the one-key inert batch the graphs were captured on. The real library and real graphs are
tests/test_cuda_graphs.py's (GPU only).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tests import fake_flashinfer, stand_in_graphs
from tests.attention_cases import Case, make_case, reference
from tpserve.engine.buckets import graph_spans, key_spans
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.graphs import CudaGraphExecutor, GraphConfig
from tpserve.engine.static_forward import StaticForward
from tpserve.engine.static_setup import graph_attention_line
from tpserve.layers.attention import AttentionSpec, bind, resolve_auto
from tpserve.layers.attention.flashinfer_backend import FlashInferAttention
from tpserve.layers.attention.torch_backend import TorchAttention

CPU = torch.device("cpu")
PAGE, PAGES, POOL, VOCAB = 16, 20, 96, 64
HEADS, DIM = (8, 2), 64


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    stand_in_graphs.install(monkeypatch)


class _Model:
    """q/k/v rows are functions of the token ids (tables the test fills per step), as a model's
    projections are: a replay must see the ids copied into the graph's static batch."""

    def __init__(self, backend: FlashInferAttention, queries: int) -> None:
        self.backend, self.queries = backend, queries
        hq, hk = HEADS
        self.tables = [torch.zeros(VOCAB, h, DIM) for h in (hq, hk, hk)]
        self.cache = (torch.zeros(POOL * PAGE, hk, DIM), torch.zeros(POOL * PAGE, hk, DIM))

    def forward(self, name: str) -> StaticForward:
        def fn(fb: ForwardBatch, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            q, k, v = (t[fb.input_ids] for t in self.tables)
            return (bind(self.backend, fb.attn)(q, k, v, self.cache),)

        return StaticForward(name, self.queries, fn, backends=lambda: (self.backend,))

    def load(self, case: Case) -> ForwardBatch:
        rows = case.q.shape[0]
        for table, src in zip(self.tables, (case.q, case.k, case.v), strict=True):
            table[1:rows + 1] = src
        for mine, theirs in zip(self.cache, case.caches(), strict=True):
            mine.zero_()
            mine[:theirs.shape[0]] = theirs
        ids = torch.arange(1, rows + 1)
        return ForwardBatch(ids, ids.clone(), case.metadata(), self.queries)


def _executor(model: _Model, name: str, buckets: tuple[int, ...], width: int = 0,
              spans: tuple[int, ...] = ()) -> CudaGraphExecutor:
    cfg = GraphConfig(buckets, PAGES * PAGE, PAGE, {name: width} if width else {}, spans)
    executor = CudaGraphExecutor(cfg, CPU, None)
    executor.capture(model.forward(name))
    return executor


def _check(model: _Model, executor: CudaGraphExecutor, name: str, case: Case) -> None:
    ref, k_ref, _ = reference(case)
    eager = TorchAttention(case.spec, CPU)
    cache = case.caches()
    torch_out = eager.forward(case.q, case.k, case.v, cache, eager.prepare(case.metadata()))
    with torch.inference_mode():  # as the engine runs steps; capture made inference tensors
        out = executor.run(name, model.load(case), {})
    assert out is not None, "no graph fits"
    assert (out[0].double() - ref).abs().max().item() <= 1e-5
    assert (out[0] - torch_out).abs().max().item() <= 1e-5
    used = k_ref.shape[0]  # page 0 is the dummy page the inert requests write to
    assert torch.equal(model.cache[0][PAGE:used], k_ref[PAGE:])


def test_fake_graph_wrapper_keeps_its_batch_and_buffers() -> None:
    fi = fake_flashinfer.module()
    ws = torch.zeros(8)
    with pytest.raises(ValueError, match="buffer"):
        fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True)
    indptr, indices, last = (torch.zeros(n, dtype=torch.int32) for n in (3, 4, 2))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
        paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
    layout = (torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([5, 6, 7], dtype=torch.int32),
              torch.tensor([3, 1], dtype=torch.int32))
    w.plan(*layout, 2, 2, 4, 4, sm_scale=0.5)
    assert indptr.tolist() == [0, 2, 3] and indices[:3].tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="batch size"):
        w.plan(layout[0][:2], layout[1][:2], layout[2][:1], 2, 2, 4, 4)
    with pytest.raises(ValueError, match="indices"):
        w.plan(layout[0], torch.arange(5, dtype=torch.int32), layout[2], 2, 2, 4, 4)


@pytest.mark.parametrize("window", [None, 40])
def test_decode_graphs_replay_flashinfer_over_growing_contexts(cpu_graphs: None,
                                                               window: int | None) -> None:
    spec = AttentionSpec(*HEADS, DIM, DIM ** -0.5, torch.float32, window)
    backend = FlashInferAttention(spec, CPU)
    model = _Model(backend, 1)
    executor = _executor(model, "decode", (2, 4))
    eager_plans = []
    backend._decode.plan = lambda *a, **k: eager_plans.append(a)  # must never run here
    # Bucket 4 with 1 inert row, then full; bucket 2 with one; contexts grow past capture's 1.
    for seed, cached in enumerate([[3, 40, 100], [250, 1, 77, 33], [17], [270, 120]]):
        case = make_case(seed, [1] * len(cached), cached, HEADS, DIM, page_size=PAGE,
                         window=window)
        case.spec = spec
        _check(model, executor, "decode", case)
        # The replayed kernel read exactly the pages in use (inert rows: the dummy page).
        bucket = 2 if len(cached) <= 2 else 4
        wrapper = next(w for meta, w in backend._static.values() if meta.batch_size == bucket)
        pages = sum(-(-(c + 1) // PAGE) for c in cached) + bucket - len(cached)
        assert int(wrapper.buffers[0][-1]) == pages
    assert not eager_plans
    assert executor.info["sets"]["decode"]["graphs"] == 2


def test_verify_graphs_attend_through_torch_under_flashinfer(cpu_graphs: None) -> None:
    spec = AttentionSpec(*HEADS, DIM, DIM ** -0.5, torch.float32)
    backend = FlashInferAttention(spec, CPU)
    model = _Model(backend, 4)
    executor = _executor(model, "verify", (2,), width=4)
    for seed, cached in enumerate([[5, 60], [200]]):
        case = make_case(seed, [4] * len(cached), cached, HEADS, DIM, page_size=PAGE,
                         mask="tree")
        _check(model, executor, "verify", case)


def test_key_spans_are_a_page_multiple_ladder_ending_at_the_limit() -> None:
    assert key_spans(131_136, 16) == (4096, 16384, 65536, 131_136)
    assert key_spans(2112, 16) == (2112,)  # a short context: one span, as before
    assert key_spans(5000, 64, first=1000, factor=2) == (1024, 2048, 4032, 5000)


def test_gathering_graphs_replay_at_the_narrowest_span_that_holds_the_step(
        cpu_graphs: None) -> None:
    """Verify graphs (a tree mask: the torch gather under FlashInfer too) are captured per key
    span and a step replays the narrowest that holds its longest request, with the same
    output; FlashInfer's decode graphs read pages in place and keep one span."""
    spec = AttentionSpec(*HEADS, DIM, DIM ** -0.5, torch.float32)
    backend = FlashInferAttention(spec, CPU)
    model = _Model(backend, 4)
    spans = (64, 160, PAGES * PAGE)
    executor = _executor(model, "verify", (2,), width=4, spans=spans)
    assert executor.spans["verify"] == {2: spans} and len(executor.graphs["verify"]) == 3
    assert executor.info["sets"]["verify"]["key_spans"] == list(spans)
    for seed, (cached, span) in enumerate([([5, 60], 64), ([100], 160), ([200, 3], 320)]):
        case = make_case(seed, [4] * len(cached), cached, HEADS, DIM, page_size=PAGE,
                         mask="tree")
        _check(model, executor, "verify", case)
        static = executor.graphs["verify"][(2, span)].batch.attn
        assert static.page_table.shape[1] * PAGE == span
        assert static.kv_lens[: len(cached)].tolist() == [c + 4 for c in cached]  # replayed here
    too_long = make_case(9, [4], [PAGES * PAGE], HEADS, DIM, page_size=PAGE, mask="tree")
    assert executor.run("verify", model.load(too_long), {}) is None  # past the limit: eager

    decode = _executor(_Model(backend, 1), "decode", (1, 2), spans=spans)
    assert decode.spans["decode"] == {1: (320,), 2: (320,)} and len(decode.graphs["decode"]) == 2


def test_a_gather_budget_keeps_large_buckets_to_their_narrowest_spans(cpu_graphs: None) -> None:
    """Bucket x span within the budget: bucket 1 gets every span, bucket 4 the narrowest
    only, so a 4-request step past 64 keys runs eagerly; the same step at 1 request replays."""
    spec = AttentionSpec(*HEADS, DIM, DIM ** -0.5, torch.float32)
    model = _Model(FlashInferAttention(spec, CPU), 4)
    cfg = GraphConfig((1, 4), PAGES * PAGE, PAGE, {"verify": 4}, (64, 160, 320), 320)
    executor = CudaGraphExecutor(cfg, CPU, None)
    executor.capture(model.forward("verify"))
    assert executor.spans["verify"] == {1: (64, 160, 320), 4: (64,)}
    assert executor.info["sets"]["verify"]["graphs"] == 4
    long = make_case(1, [4] * 3, [100, 3, 9], HEADS, DIM, page_size=PAGE, mask="tree")
    assert executor.run("verify", model.load(long), {}) is None
    short = make_case(2, [4] * 3, [30, 3, 9], HEADS, DIM, page_size=PAGE, mask="tree")
    _check(model, executor, "verify", short)
    alone = make_case(3, [4], [250], HEADS, DIM, page_size=PAGE, mask="tree")
    _check(model, executor, "verify", alone)


def test_graph_spans_always_keep_the_narrowest() -> None:
    assert graph_spans((1, 8, 64), (4096, 16384, 65536), 131072) == {
        1: (4096, 16384, 65536), 8: (4096, 16384), 64: (4096,)}
    assert graph_spans((2,), (64, 128), None) == {2: (64, 128)}


def test_recapture_releases_the_static_batches(cpu_graphs: None) -> None:
    backend = FlashInferAttention(AttentionSpec(*HEADS, DIM, DIM ** -0.5, torch.float32), CPU)
    model = _Model(backend, 1)
    forward = model.forward("decode")
    executor = _executor(model, "decode", (1, 2))
    executor.refresh([forward])
    assert len(backend._static) == 2


def test_auto_picks_flashinfer_on_cuda_when_it_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    spec = AttentionSpec(32, 8, 128, 128 ** -0.5, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n == "flashinfer" else real(n, *a))
    assert resolve_auto(spec, cuda) == "flashinfer"
    odd = AttentionSpec(32, 8, 96, 96 ** -0.5, torch.bfloat16)
    assert resolve_auto(odd, cuda) == "torch"
    line = graph_attention_line("auto", TorchAttention(odd, CPU), cuda)
    assert "'torch'" in line and "head_dim 96" in line and "context limit" in line
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "flashinfer" else real(n, *a))
    assert resolve_auto(spec, cuda) == "torch"
    line = graph_attention_line("auto", TorchAttention(spec, CPU), cuda)
    assert "not installed" in line
