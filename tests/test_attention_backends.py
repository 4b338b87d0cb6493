"""Attention backends (tpserve/layers/attention/) against a float64 reference.

Every backend this machine runs (``torch`` and the native ``cpu`` op here; ``flashinfer`` in
test_attention_gpu.py) must, on random page layouts (tests/attention_cases.py: fragmented and
shared pages, page sizes 16 / 5 / 1, lengths of 1 and on page and split boundaries, GQA ratios
1/2/4/8, head dims 64/128, sliding windows, chunked prefill over a cached prefix, verify trees,
draft-step ancestor masks, decode):
- write this step's keys/values to exactly the right slots (the caches equal the reference's);
- equal the float64 attention within 1e-5 with an fp32 cache, and within one output rounding
  (native) or a bf16/fp16 SDPA tolerance (torch) with 16-bit caches;
- the native kernel on both its ISA paths (AVX2 built with -mno-avx512f, AVX-512 where the CPU
  has it), with any thread count and batch composition giving the same bits per row.
Also: the registry's choices and refusals, the fallback when the native op is off, layout
checks, and the engine's layout expansion giving the same metadata.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from launch.machine import machine_info
from tests.attention_cases import Case, make_case, reference
from tests.attention_ctypes import NativeKernel
from tpserve.engine.plan import Layout, build_forward_batch
from tpserve.errors import ConfigError
from tpserve.layers import cpu_ops
from tpserve.layers.attention import (
    AttentionSpec,
    available,
    build_metadata,
    cpu_native,
    create,
)
from tpserve.layers.attention.metadata import write_slots_for
from tpserve.layers.attention.registry import NAMES

CPU = torch.device("cpu")
SCENARIOS = {
    "decode": dict(q_lens=[1] * 6, cached=[0, 1, 15, 16, 31, 200]),
    "prefill": dict(q_lens=[1, 16, 37], cached=[0, 16, 5]),
    "mixed": dict(q_lens=[1, 1, 24, 1], cached=[40, 0, 9, 1023]),
    "window": dict(q_lens=[1, 9, 30], cached=[50, 21, 3], window=13),
    "shared": dict(q_lens=[1, 5, 2], cached=[37, 33, 12], share=True, page_size=5),
    "tiny_pages": dict(q_lens=[3, 1], cached=[9, 20], page_size=1),
    "tree": dict(q_lens=[7, 7, 7], cached=[0, 20, 35], mask="tree"),
    "tree_window": dict(q_lens=[6, 6], cached=[30, 17], mask="tree", window=9),
    "draft": dict(q_lens=[3, 3], cached=[10, 47], mask="draft", draft_step=2),
    "long": dict(q_lens=[1, 40], cached=[2500, 1100]),
}
HEADS = [(4, 4), (4, 2), (8, 2), (8, 1)]
BACKENDS = ["torch", "cpu"]


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before, pool_before = torch.get_num_threads(), cpu_ops.set_matmul_threads(1)
    torch.set_num_threads(2)  # the native op's threaded path (a no-op on one core)
    cpu_ops.set_matmul_threads(2)  # ... which runs on tpserve::matmul's pool
    yield
    torch.set_num_threads(before)
    cpu_ops.set_matmul_threads(pool_before)


def run(backend: str, case: Case) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    attn = create(backend, case.spec, CPU)
    cache = case.caches()
    out = attn.forward(case.q, case.k, case.v, cache, attn.prepare(case.metadata()))
    return out, cache


def test_the_native_op_builds_here() -> None:
    native = cpu_native.load()
    assert native.reason == "" and native.lanes in (8, 16), native.reason


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 16: the narrow op on AVX-512
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fp32_equals_float64(backend: str, head_dim: int, heads: tuple[int, int],
                             scenario: str) -> None:
    case = make_case(len(scenario) * 7 + heads[0] * 3 + heads[1] + head_dim, heads=heads,
                     head_dim=head_dim, **SCENARIOS[scenario])
    ref, k_ref, v_ref = reference(case)
    out, (k_cache, v_cache) = run(backend, case)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert (out.double() - ref).abs().max().item() <= 1e-5


# torch's 16-bit SDPA rounds intermediates; the native kernel rounds once, at the output.
TORCH_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


def one_rounding(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half an ulp of ``dtype`` at each value, plus 1e-5 for the fp32 arithmetic before it."""
    bits = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    mag = ref.to(dtype).double().abs().clamp_min(torch.finfo(dtype).tiny)
    return 0.5 * torch.exp2(torch.floor(torch.log2(mag)) - (bits - 1)) + 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scenario", ["decode", "mixed", "window", "tree", "long"])
def test_16_bit_caches(backend: str, dtype: torch.dtype, scenario: str) -> None:
    case = make_case(5, heads=(8, 2), head_dim=128, dtype=dtype, **SCENARIOS[scenario])
    ref, k_ref, v_ref = reference(case)
    out, (k_cache, v_cache) = run(backend, case)
    assert out.dtype == dtype and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    err = (out.double() - ref).abs()
    if backend == "cpu":
        assert (err <= one_rounding(ref, dtype)).all()
    else:
        assert (err <= TORCH_TOL[dtype] * (1 + ref.abs())).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(torch.float32, torch.bfloat16),
                                                      (torch.bfloat16, torch.float32)])
def test_q_dtype_other_than_the_cache(backend: str, q_dtype: torch.dtype,
                                      cache_dtype: torch.dtype) -> None:
    """New keys/values are converted to the cache dtype, the output has q's dtype."""
    case = make_case(6, heads=(4, 2), head_dim=64, dtype=cache_dtype, **SCENARIOS["mixed"])
    case.q, case.k, case.v = (t.to(q_dtype) for t in (case.q, case.k, case.v))
    ref, k_ref, v_ref = reference(case)
    out, (k_cache, v_cache) = run(backend, case)
    assert out.dtype == q_dtype and torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    err = (out.double() - ref).abs()
    if q_dtype == torch.float32:
        assert err.max().item() <= 1e-5
    elif backend == "cpu":
        assert (err <= one_rounding(ref, q_dtype)).all()
    else:  # torch attends in q's dtype: the fp32 keys are rounded to bf16 first
        assert (err <= TORCH_TOL[q_dtype] * (1 + ref.abs())).all()


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_native_isa_paths(isa: str) -> None:
    """paged_attention.c built for one ISA and run through ctypes, every scenario."""
    if isa == "avx512" and "avx512f" not in machine_info()["flags"]:
        pytest.skip("this CPU has no AVX-512 (its AVX2 path is tested)")
    kernel = NativeKernel(("-mno-avx512f",) if isa == "avx2" else ())
    assert kernel.lanes == (8 if isa == "avx2" else 16)
    for i, (name, kwargs) in enumerate(SCENARIOS.items()):
        for dtype in (torch.float32, torch.bfloat16):
            case = make_case(100 + i, heads=HEADS[i % 4], head_dim=64 * (1 + i % 2),
                             dtype=dtype, **kwargs)
            ref, k_ref, v_ref = reference(case)
            out, k_cache, v_cache = kernel.run(case)
            assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), name
            bound = 1e-5 if dtype == torch.float32 else one_rounding(ref, dtype)
            assert ((out.double() - ref).abs() <= bound).all(), (name, dtype)


def test_native_rows_do_not_depend_on_threads_or_batch() -> None:
    """A row's bits depend on its own keys only: not on the thread count, the other requests
    of the batch, or whether its request is split into several work items."""
    case = make_case(9, q_lens=[1, 1, 30, 1], cached=[3000, 17, 40, 1500], heads=(8, 2),
                     head_dim=64, dtype=torch.bfloat16)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(run("cpu", case)[0])
    assert torch.equal(outs[0], outs[1])
    alone = make_case(9, q_lens=[1], cached=[3000], heads=(8, 2), head_dim=64,
                      dtype=torch.bfloat16)
    alone.q, alone.k, alone.v = case.q[:1], case.k[:1], case.v[:1]
    alone.k_cache, alone.v_cache = case.k_cache, case.v_cache
    alone.page_table = case.page_table[:1]
    assert torch.equal(run("cpu", alone)[0], outs[0][:1])


def test_native_refuses_bad_layouts() -> None:
    case = make_case(3, q_lens=[2, 1], cached=[5, 30], heads=(4, 2), head_dim=64)
    case.page_table[1, 1] = 10_000  # a page id past the cache
    with pytest.raises(RuntimeError, match="page id"):
        run("cpu", case)
    case = make_case(3, q_lens=[2, 1], cached=[5, 30], heads=(4, 2), head_dim=64)
    attn = create("cpu", case.spec, CPU)
    step = attn.prepare(case.metadata())
    with pytest.raises(RuntimeError, match="row"):  # q rows that do not match q_indptr
        attn.forward(case.q[:2], case.k[:2], case.v[:2], case.caches(), step)
    with pytest.raises(ValueError, match="q_len"):  # more new tokens than keys
        build_metadata(np.ones((1, 1), np.int32), [3], [2], 16, CPU)
    with pytest.raises(ValueError, match="page table"):
        build_metadata(np.ones((1, 1), np.int32), [1], [17], 16, CPU)


@pytest.mark.parametrize("batch,uniform", [(1, True), (5, False), (5, True), (40, False),
                                           (90, True)])
def test_write_slots_equal_the_ragged_numpy_path(batch: int, uniform: bool) -> None:
    """Every way the metadata computes write slots (Python ints for small batches, the
    uniform block, the ragged numpy index) lands each row where ``write_slots_for`` does."""
    gen = np.random.default_rng(batch)
    page_size, width = 4, 12
    pages = gen.permutation(batch * width).reshape(batch, width).astype(np.int32) + 1
    q = np.full(batch, 3) if uniform else gen.integers(0, 6, batch)
    kv = q + gen.integers(0, page_size * width - 6, batch)
    meta = build_metadata(pages, q, kv, page_size, CPU)
    expected = write_slots_for(pages, q.astype(np.int32), kv.astype(np.int32), page_size)
    assert meta.write_slots.tolist() == expected.tolist()
    assert meta.q_indptr.tolist() == [0, *np.cumsum(q).tolist()]
    assert meta.uniform_q_len == (3 if uniform else 0)
    assert (meta.max_q_len, meta.max_kv_len) == (int(q.max()), int(kv.max()))
    logical = [i for qb, kb in zip(q, kv, strict=True) for i in range(kb - qb, kb)]
    rows = np.repeat(np.arange(batch), q)
    assert expected.tolist() == [int(pages[b, i // page_size]) * page_size + i % page_size
                                 for b, i in zip(rows, logical, strict=True)]


def test_registry() -> None:
    spec = AttentionSpec(8, 4, 64, 0.125, torch.bfloat16)
    assert NAMES == ("auto", "torch", "cpu", "flashinfer")
    assert create("auto", spec, CPU).name == "cpu"
    assert {"torch", "cpu"} <= set(available(spec, CPU))
    odd = AttentionSpec(8, 4, 72, 0.125, torch.bfloat16)  # not a multiple of 2 x 16 / 2 x 8
    assert create("auto", odd, CPU).name == "torch"
    with pytest.raises(ConfigError) as info:
        create("cpu", odd, CPU)
    assert info.value.flag == "--attention-backend" and "head_dim 72" in str(info.value)
    for name in ("flashinfer", "nope"):
        with pytest.raises(ConfigError) as info:
            create(name, spec, CPU)
        assert info.value.flag == "--attention-backend" and "\n" not in str(info.value)


def test_native_op_compiles() -> None:
    """torch.compile(fullgraph) traces the op (its fake shape and the cache mutation)."""
    torch.set_num_threads(1)
    case = make_case(8, q_lens=[1, 1, 3], cached=[5, 40, 17], heads=(8, 2), head_dim=64)
    ref, k_ref, v_ref = reference(case)
    attn = create("cpu", case.spec, CPU)
    step = attn.prepare(case.metadata())

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> torch.Tensor:
        return attn.forward(q * 1.0, k, v, (k_cache, v_cache), step) + 0.0

    k_cache, v_cache = case.caches()
    out = torch.compile(layer, backend="aot_eager", fullgraph=True)(
        case.q, case.k, case.v, k_cache, v_cache)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert (out.double() - ref).abs().max().item() <= 1e-5


_DISABLED = """
import torch
from tpserve.errors import ConfigError
from tpserve.layers.attention import AttentionSpec, create
spec = AttentionSpec(8, 4, 64, 0.125, torch.bfloat16)
try:
    create("cpu", spec, torch.device("cpu"))
except ConfigError as exc:
    print("refused:", exc)
print(create("auto", spec, torch.device("cpu")).name)
"""


def test_disabled_native_op_falls_back_to_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _DISABLED], capture_output=True, text=True,
                         env={**os.environ, "TPSERVE_CPU_ATTENTION": "0"}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "TPSERVE_CPU_ATTENTION=0" in out.stdout and out.stdout.split()[-1] == "torch"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["prefill", "verify"])
def test_the_engine_layout_builds_the_same_attention(backend: str, kind: str) -> None:
    """A step's compact layout through the engine's build_forward_batch gives exactly the
    metadata (and so the rows) the backends are checked with above."""
    case = make_case(4, q_lens=[5, 5] if kind == "verify" else [3, 12], cached=[20, 9],
                     heads=(4, 2), head_dim=64, window=11,
                     mask="tree" if kind == "verify" else None)
    layout = Layout(np.zeros(int(case.q_lens.sum()), dtype=np.int64), case.q_lens,
                    case.kv_lens - case.q_lens, case.page_table)
    fb = build_forward_batch(layout, case.page_size, CPU, mask_start=case.mask_start,
                             custom_mask=case.custom_mask)
    attn = create(backend, case.spec, CPU)
    cache = case.caches()
    ours = attn.forward(case.q, case.k, case.v, cache, attn.prepare(fb.attn))
    ref, _ = run(backend, case)
    assert torch.equal(ours, ref)


def test_narrow_op_serves_16_wide_heads() -> None:
    """On AVX-512 the AVX2 build (tpserve::paged_attention_narrow) takes head sizes that are
    multiples of 16 but not of 32; elsewhere the one build takes them."""
    native = cpu_native.load()
    spec = AttentionSpec(8, 4, 16, 0.25, torch.bfloat16)
    attn = create("auto", spec, CPU)
    assert attn.name == "cpu"
    assert attn.narrow == (native.lanes == 16)
    assert native.op_for(48) == ("paged_attention_narrow" if native.lanes == 16
                                 else "paged_attention")
    assert native.op_for(64) == "paged_attention" and native.op_for(8) is None
