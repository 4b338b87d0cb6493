"""The fused CPU ops (tpserve::rms_norm, add_rms_norm, rotary_qk, silu_mul) give the same bits
as the torch expressions they replace (``tpserve/layers/fused.py``'s references), for every
16-bit and fp32 dtype, one row (decode) and many (prefill, split over the pool's threads),
strided inputs, and refuse malformed ones. The greedy pick (tpserve::greedy_logprob) picks
torch.argmax's token, and it, tpserve::logsumexp and tpserve::softmax are within float rounding
of float64, on logits spread far wider than exp's range too (masked tokens exactly 0)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from comm_backends.native_build import load_library
from tpserve.layers import cpu_ops, fused

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS = [1, 7, 100]


@pytest.fixture(autouse=True)
def threads() -> Iterator[None]:
    # One torch thread: the reference's mean_square then sums every row in the fixed fp64
    # order (ATen's pow + mean, which it uses for large inputs on several threads, rounds
    # differently); two pool threads: the ops' row chunks run on both.
    if cpu_ops.load().impl != "c++":
        pytest.skip(f"the C++ ops did not build here: {cpu_ops.load().reason}")
    before, pool = torch.get_num_threads(), cpu_ops.set_matmul_threads(2)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    cpu_ops.set_matmul_threads(pool)


def _rand(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_bits(dtype: torch.dtype, rows: int) -> None:
    x = _rand(rows, 512, dtype=dtype, scale=3.0, seed=rows)
    w = (torch.rand(512, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    out = torch.ops.tpserve.rms_norm(x, w, 1e-6)
    assert torch.equal(out, fused.rms_norm_reference(x, w, 1e-6))
    # and it is a norm: rows of the unscaled output have mean square ~1
    unit = torch.ops.tpserve.rms_norm(x, torch.ones_like(w), 1e-6).double()
    assert torch.allclose(unit.pow(2).mean(-1), torch.ones(rows, dtype=torch.float64), atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_bits(dtype: torch.dtype, rows: int) -> None:
    wide = _rand(rows, 1024, dtype=dtype, scale=2.0, seed=rows)
    x = wide[:, :512]  # a strided view: rows 1024 apart
    delta = _rand(rows, 512, dtype=dtype, seed=rows + 1)
    w = _rand(512, dtype=dtype, seed=3)
    total, normed = torch.ops.tpserve.add_rms_norm(x, delta, w, 1e-5)
    ref_total, ref_normed = fused.add_rms_norm_reference(x, delta, w, 1e-5)
    assert torch.equal(total, ref_total) and torch.equal(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads", [(8, 4, 64), (4, 1, 128), (2, 2, 32), (8, 8, 16), (2, 1, 6)])
def test_rotary_qk_bits(dtype: torch.dtype, rows: int, heads: tuple[int, int, int]) -> None:
    hq, hk, d = heads
    qkv = _rand(rows, (hq + 2 * hk) * d, dtype=dtype, scale=2.0, seed=rows + hq)
    angles = torch.rand(rows, 1, d, generator=torch.Generator().manual_seed(5)) * 7
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q, k = torch.ops.tpserve.rotary_qk(qkv, cos, sin, hq, hk, d)
    ref_q, ref_k = fused.rotary_qk_reference(qkv, cos, sin, hq, hk, d)
    assert q.shape == (rows, hq, d) and k.shape == (rows, hk, d)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_qk_special_values_bits(dtype: torch.dtype) -> None:
    """inf, NaN, signed zeros and values that round at a tie, through both the vector lanes
    (head_dim 16) and the scalar loop (head_dim 6): the reference's bits, NaNs included."""
    for d in (16, 6):
        qkv = _rand(3, 4 * d, dtype=dtype, scale=2.0, seed=d)
        qkv[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
        qkv[1, 1] = 1.0 + 2.0 ** -8  # a bf16 tie once multiplied by 1
        angles = torch.rand(3, 1, d, generator=torch.Generator().manual_seed(d)) * 7
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        cos[2, 0, 0] = 1.0
        q, k = torch.ops.tpserve.rotary_qk(qkv, cos, sin, 2, 1, d)
        ref_q, ref_k = fused.rotary_qk_reference(qkv, cos, sin, 2, 1, d)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(q.contiguous().view(bits), ref_q.contiguous().view(bits))
        assert torch.equal(k.contiguous().view(bits), ref_k.contiguous().view(bits))


def test_rotary_matches_float64_rotation() -> None:
    """Against the rotation itself: pairs (i, i + D/2) turned by each token's angle."""
    rows, hq, hk, d = 5, 2, 1, 16
    qkv = _rand(rows, (hq + 2 * hk) * d, dtype=torch.float32, seed=9)
    theta = torch.rand(rows, 1, d // 2, generator=torch.Generator().manual_seed(2)) * 6
    angles = torch.cat((theta, theta), dim=-1)
    q, _ = torch.ops.tpserve.rotary_qk(qkv, angles.cos(), angles.sin(), hq, hk, d)
    x = qkv[:, : hq * d].reshape(rows, hq, d).double()
    a, b, t = x[..., : d // 2], x[..., d // 2 :], theta.double()
    expected = torch.cat((a * t.cos() - b * t.sin(), b * t.cos() + a * t.sin()), dim=-1)
    assert torch.allclose(q.double(), expected, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_bits(dtype: torch.dtype, rows: int) -> None:
    x = _rand(rows, 2 * 1408, dtype=dtype, scale=4.0, seed=rows)
    assert torch.equal(torch.ops.tpserve.silu_mul(x), fused.silu_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rows_bits(dtype: torch.dtype) -> None:
    """Rows of the fp32 tables cast like ATen's index + cast, negative positions included;
    values near the bf16 / fp16 rounding ties and past fp16's range too."""
    cos = _rand(300, 64, dtype=torch.float32, scale=3.0, seed=1)
    sin = _rand(300, 64, dtype=torch.float32, scale=3e4, seed=2)
    positions = torch.tensor([0, 299, 5, 5, -1, 17, 123])
    for pos in (positions, positions.to(torch.int32)):
        got = torch.ops.tpserve.rotary_rows(cos, sin, pos, dtype)
        want = fused.rotary_rows_reference(cos, sin, pos.long(), dtype)
        for g, w in zip(got, want, strict=True):
            assert g.shape == (7, 1, 64) and g.dtype == dtype
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(fused.rotary_rows(cos, sin, positions, dtype)[1],
                       fused.rotary_rows_reference(cos, sin, positions, dtype)[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_rotary_equals_embedding_and_rotary_rows(dtype: torch.dtype) -> None:
    """The stack's inputs in one call: F.embedding's rows (repeated and boundary ids) and
    rotary_rows in the table's dtype, bit for bit, as a fresh tensor."""
    table = _rand(50, 96, dtype=dtype, scale=2.0, seed=3)
    cos = _rand(300, 64, dtype=torch.float32, scale=3.0, seed=4)
    sin = _rand(300, 64, dtype=torch.float32, scale=3.0, seed=5)
    ids, positions = torch.tensor([0, 49, 7, 7, 23]), torch.tensor([0, 299, 5, 5, 17])
    x, c, s = torch.ops.tpserve.embed_rotary(ids, table, cos, sin, positions)
    want = (torch.nn.functional.embedding(ids, table),
            *fused.rotary_rows_reference(cos, sin, positions, dtype))
    for got, ref in zip((x, c, s), want, strict=True):
        assert got.shape == ref.shape and got.dtype == dtype
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    x[0] = 0  # a copy: the table is untouched
    assert torch.equal(table[0], want[0][0])
    assert all(torch.equal(g, w) for g, w in zip(fused.embed_rotary(ids, table, cos, sin, positions),
                                                 want, strict=True))


def test_embed_rotary_rejects_ids_outside_the_table() -> None:
    table, rot = torch.zeros(10, 8, dtype=torch.bfloat16), torch.zeros(16, 4)
    for bad in ([3, 10], [-1]):
        with pytest.raises(RuntimeError, match="outside the embedding table"):
            torch.ops.tpserve.embed_rotary(torch.tensor(bad), table, rot, rot,
                                           torch.zeros(len(bad), dtype=torch.long))


def test_rotary_rows_rejects_positions_past_the_table() -> None:
    table = torch.zeros(10, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        torch.ops.tpserve.rotary_rows(table, table, torch.tensor([3, 10]), torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        torch.ops.tpserve.rotary_rows(table, table, torch.tensor([-11]), torch.bfloat16)


def test_dispatchers_agree_with_the_references() -> None:
    """``fused.*`` call the ops on CPU; the references (what CUDA runs) agree with them."""
    x = _rand(3, 64, dtype=torch.bfloat16, seed=4)
    w = torch.ones(64, dtype=torch.bfloat16)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), fused.rms_norm_reference(x, w, 1e-6))
    assert torch.equal(fused.silu_mul(x), fused.silu_mul_reference(x))


@pytest.mark.parametrize("call", [
    lambda: torch.ops.tpserve.rms_norm(torch.ones(2, 8), torch.ones(4), 1e-6),
    lambda: torch.ops.tpserve.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6),
    lambda: torch.ops.tpserve.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-6),
    lambda: torch.ops.tpserve.rotary_qk(torch.ones(2, 10), torch.ones(2, 1, 4), torch.ones(2, 1, 4),
                                        2, 1, 4),
    lambda: torch.ops.tpserve.rms_norm(torch.ones(2, 8, dtype=torch.int32),
                                       torch.ones(8, dtype=torch.int32), 1e-6),
], ids=["weight-size", "weight-dtype", "delta-shape", "qkv-too-narrow", "int-dtype"])
def test_malformed_inputs_raise(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError):
        call()


@pytest.mark.parametrize("scale", [5.0, 60.0])
@pytest.mark.parametrize("rows", [1, 5])
def test_greedy_logprob_against_float64(rows: int, scale: float) -> None:
    """Spread 60: most of a row lies more than 88 below its maximum (exp underflows there)."""
    logits = _rand(rows, 32000, dtype=torch.float32, scale=scale, seed=rows)
    logits[0, 17] = logits[0, 4000] = logits.max() + 1  # a tie: the first index wins
    logits[-1, 5000:5900] = float("-inf")  # masked tokens
    tokens, lps = torch.ops.tpserve.greedy_logprob(logits)
    ref_tokens, ref_lps = fused.greedy_logprob_reference(logits)
    assert tokens[0] == 17 and torch.equal(tokens, ref_tokens)
    exact = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(lps.double(), exact, rtol=1e-5, atol=1e-5), (lps, exact)
    assert torch.allclose(lps, ref_lps, rtol=1e-5, atol=1e-5)
    lse = torch.ops.tpserve.logsumexp(logits)
    assert torch.allclose(lse.double(), torch.logsumexp(logits.double(), -1), rtol=1e-5)
    assert torch.equal(fused.logsumexp(logits), lse)
    probs = torch.ops.tpserve.softmax(logits)
    exact_probs = torch.softmax(logits.double(), -1)
    assert torch.allclose(probs.double(), exact_probs, rtol=1e-5, atol=1e-9)
    assert (probs[-1, 5000:5900] == 0).all() and torch.equal(fused.softmax(logits), probs)


@pytest.mark.parametrize("where", ["vector", "tail", "nan-vector", "nan-tail"])
def test_greedy_logprob_finds_the_first_max_anywhere(where: str) -> None:
    """A vocabulary that is not a multiple of the vector width: the scalar tail counts too."""
    logits = _rand(2, 32003, dtype=torch.float32, seed=11)
    spot = {"vector": 31990, "tail": 32001, "nan-vector": 100, "nan-tail": 32002}[where]
    logits[1, spot] = float("nan") if where.startswith("nan") else 50.0
    logits[1, 20] = 50.0 if where == "tail" else logits[1, 20]  # an earlier equal max wins
    tokens, lps = torch.ops.tpserve.greedy_logprob(logits)
    ref_tokens, ref_lps = fused.greedy_logprob_reference(logits)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(lps, ref_lps, rtol=1e-5, atol=1e-5)  # NaN rows: both pushed finite


def test_greedy_logprob_extremes_are_finite() -> None:
    logits = torch.zeros(3, 8)
    logits[0, 2] = float("nan")  # NaN counts as the maximum, as torch.argmax
    logits[1] = float("-inf")
    logits[1, 5] = float("inf")
    tokens, lps = torch.ops.tpserve.greedy_logprob(logits)
    ref_tokens, ref_lps = fused.greedy_logprob_reference(logits)
    assert torch.equal(tokens, ref_tokens) and torch.equal(lps, ref_lps)
    assert torch.isfinite(lps).all() and tokens[0] == 2
    # Rows whose maximum is not finite keep torch's log-sum-exp (NaN, +inf, -inf).
    logits[2] = float("-inf")
    assert torch.allclose(torch.ops.tpserve.logsumexp(logits), logits.logsumexp(-1),
                          equal_nan=True)
    assert torch.allclose(torch.ops.tpserve.softmax(logits), torch.softmax(logits, -1),
                          equal_nan=True)


def logsumexp_library(isa: str) -> ctypes.CDLL:
    """logsumexp.c built alone for one vector path (skips where the CPU lacks it)."""
    if isa == "avx512" and "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX-512 (its AVX2 path is tested)")
    here = Path(fused.__file__).parent
    flags = ("-mno-avx512f",) if isa == "avx2" else ()
    lib, lanes = load_library(here / "logsumexp.c", "logsumexp_lanes",
                              (here / "attention" / "attn_simd.h", here / "half.h"), flags)
    assert lanes == (8 if isa == "avx2" else 16)
    return lib


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_logsumexp_kernel_on_both_isa_paths(isa: str) -> None:
    """logsumexp.c built alone for each vector path against float64 (its log-sum-exp and
    softmax), at every row length (two-vector blocks, single vectors, the scalar tail) and on
    rows spread past exp's range."""
    lib = logsumexp_library(isa)
    fn = lib.log_sum_exp_shifted
    fn.restype = ctypes.c_float
    fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float)
    softmax = lib.softmax_shifted
    softmax.restype = None
    softmax.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p)
    gen = torch.Generator().manual_seed(3)
    for n in (1, 7, 8, 16, 33, 47, 2048, 32003):
        for scale in (1.0, 40.0):
            row = torch.randn(n, generator=gen) * scale
            if n > 1:
                row[n // 2] = float("-inf")
            top = float(row.max())
            exact = float(torch.logsumexp(row.double() - top, 0))
            got = fn(row.data_ptr(), n, top)
            assert got == pytest.approx(exact, rel=1e-6, abs=1e-6), (n, scale)
            probs = torch.empty(n)
            softmax(row.data_ptr(), n, top, probs.data_ptr())
            assert torch.allclose(probs.double(), torch.softmax(row.double(), 0), rtol=1e-5,
                                  atol=1e-9), (n, scale)
            assert n == 1 or probs[n // 2] == 0  # the -inf entry


def _inverse_cdf64(row: torch.Tensor, inv_t: float, u: torch.Tensor) -> torch.Tensor:
    """float64 reference: the first token whose cumulative weight exp((x - max) * inv_t)
    exceeds u times the total, for each uniform in ``u``."""
    weights = torch.exp((row.double() - row.double().max()) * inv_t)
    cum = weights.cumsum(0)
    return torch.searchsorted(cum, u * cum[-1], right=True).clamp(max=row.numel() - 1)


def _near_a_boundary(row: torch.Tensor, inv_t: float, u: torch.Tensor) -> torch.Tensor:
    """Uniforms within float rounding of a cumulative boundary, where float32 weights and
    float64 ones may pick neighbouring tokens."""
    weights = torch.exp((row.double() - row.double().max()) * inv_t)
    cum = weights.cumsum(0) / weights.sum()
    gap = (cum[None, :] - u[:, None]).abs().min(dim=1).values
    return gap < 1e-5


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_draw_kernel_on_both_isa_paths(isa: str) -> None:
    """logsumexp.c's draw built alone for each vector path: at row lengths around its vector
    blocks and its 256-token draw blocks, at three temperatures, on a grid of uniforms, the
    float64 inverse CDF's token (bar uniforms on a boundary), never a masked one."""
    lib = logsumexp_library(isa)
    weigh = lib.tempered_weights
    weigh.restype = ctypes.c_double
    weigh.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_float,
                      ctypes.c_void_p, ctypes.c_void_p)
    walk = lib.draw_weights
    walk.restype = ctypes.c_int64
    walk.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double,
                     ctypes.c_double)

    def draw(row: int, n: int, top: float, inv_t: float, u: float, work: int, sums: int) -> int:
        total = weigh(row, n, top, inv_t, work, sums)
        return walk(work, n, sums, total, u) if total > 0 else -1

    blocks = lib.draw_blocks
    blocks.restype, blocks.argtypes = ctypes.c_int64, (ctypes.c_int64,)
    gen = torch.Generator().manual_seed(5)
    uniforms = torch.cat([torch.tensor([0.0, 1.0 - 2.0 ** -53]),
                          torch.rand(400, generator=gen, dtype=torch.float64)])
    for n in (1, 7, 16, 33, 255, 256, 257, 1000, 32003):
        row = torch.randn(n, generator=gen) * 3
        if n > 2:
            row[n // 2] = float("-inf")
        work, sums = torch.empty(n), torch.empty(blocks(n), dtype=torch.float64)
        for inv_t in (0.5, 1.0, 1.0 / 0.7):
            want = _inverse_cdf64(row, inv_t, uniforms)
            got = torch.tensor([draw(row.data_ptr(), n, float(row.max()), inv_t, float(u),
                                     work.data_ptr(), sums.data_ptr()) for u in uniforms])
            assert n <= 2 or not (got == n // 2).any(), (n, inv_t)  # the masked token
            differ = got != want
            assert not (differ & ~_near_a_boundary(row, inv_t, uniforms)).any(), (n, inv_t)
        assert draw(row.data_ptr(), n, float(row.max()), float("inf"), 0.5, work.data_ptr(),
                    sums.data_ptr()) == -1


def _no_filter(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.float64),
            torch.zeros(rows, dtype=torch.float64))


def test_sample_rows_op_matches_the_reference_and_the_general_logprob() -> None:
    """``tpserve::sample_rows`` unfiltered: each row's token is the float64 inverse CDF's for
    its own temperature and uniform, its log-probability the general path's (logit -
    logsumexp), and rows it cannot draw (a maximum that is not finite, a non-finite inverse
    temperature) come back as -1 from the op and its reference alike."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 3001, generator=gen) * 4
    logits[1, 100:2000] = float("-inf")
    logits[4] = float("-inf")
    logits[4, 9] = float("inf")  # maximum not finite
    inv = torch.tensor([1.0, 1.25, 0.5, 2.0, 1.0, float("inf")])
    uniforms = torch.rand(6, generator=gen, dtype=torch.float64)
    tokens, lps = torch.ops.tpserve.sample_rows(logits, inv, *_no_filter(6), uniforms)
    ref_tokens, ref_lps = fused.sample_rows_reference(logits, inv, *_no_filter(6), uniforms)
    assert tokens[4] == -1 and tokens[5] == -1
    assert torch.equal(ref_tokens[4:], tokens[4:])
    for r in range(4):
        assert int(tokens[r]) == int(_inverse_cdf64(logits[r], float(inv[r]), uniforms[r:r + 1]))
        assert int(ref_tokens[r]) == int(tokens[r])
    general = (logits.gather(1, tokens[:4, None].clamp(min=0)).squeeze(1)
               - torch.ops.tpserve.logsumexp(logits)[:4])
    assert torch.equal(lps[:4], general)
    assert torch.allclose(ref_lps[:4], general, atol=1e-5)
    assert not (100 <= tokens[1] < 2000)


@pytest.mark.parametrize("vocab", [50, 3001, 20000])
def test_sample_rows_filters_as_the_sampler_does(vocab: int) -> None:
    """Filtered rows (top-k, top-p, min-p and their mixes, flat and peaked, with masked tokens
    and ties): over a grid of uniforms the op draws what the float64 reference of the
    sampler's filters draws: a token kept or dropped wrongly would move every boundary
    after it."""
    gen = torch.Generator().manual_seed(vocab)
    filters = [(5, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.3, 0.0), (0, 1.0, 0.05), (40, 0.8, 0.0),
               (10, 0.95, 0.1), (0, 0.6, 0.2), (1000000, 1.0, 0.0), (vocab - 1, 0.99, 0.0),
               (3, 1e-9, 0.0)]
    rows = len(filters)
    scales = torch.tensor([3.0, 1.0, 5.0, 2.0, 0.5, 4.0, 1.5, 3.0, 0.2, 2.0])[:, None]
    logits = torch.randn(rows, vocab, generator=gen) * scales
    logits[:, 1::7] = float("-inf")
    logits[2, :4] = logits[2].max() + 1.0  # a tie at the top
    inv = torch.tensor([1.0, 1.3, 0.7, 1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.0])
    k = torch.tensor([f[0] for f in filters])
    p = torch.tensor([f[1] for f in filters], dtype=torch.float64)
    m = torch.tensor([f[2] for f in filters], dtype=torch.float64)
    uniforms = torch.linspace(0.0, 1.0 - 1e-9, 201, dtype=torch.float64)
    for r in range(rows):
        many = logits[r : r + 1].expand(len(uniforms), vocab).contiguous()
        args = (many, inv[r].expand(len(uniforms)).contiguous(), k[r].expand(len(uniforms)),
                p[r].expand(len(uniforms)), m[r].expand(len(uniforms)), uniforms)
        got = torch.ops.tpserve.sample_rows(*[a.contiguous() for a in args])[0]
        want = fused.sample_rows_reference(*args)[0]
        assert (logits[r, got] > float("-inf")).all(), filters[r]
        # Equal bar a uniform on a boundary (float32 weights against float64), none seen.
        assert int((got != want).sum()) <= 1, filters[r]


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_argmax_kernel_on_both_isa_paths(isa: str) -> None:
    """argmax.c built alone for each vector path, against torch.argmax (first max, NaN first)."""
    if isa == "avx512" and "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX-512 (its AVX2 path is tested)")
    source = Path(fused.__file__).with_name("argmax.c")
    flags = ("-mno-avx512f",) if isa == "avx2" else ()
    lib, lanes = load_library(source, "argmax_lanes", extra_flags=flags)
    assert lanes == (8 if isa == "avx2" else 16)
    fn = lib.argmax_first
    fn.restype, fn.argtypes = ctypes.c_int64, (ctypes.c_void_p, ctypes.c_int64)
    gen = torch.Generator().manual_seed(21)
    for n in (1, 7, 8, 16, 33, 32000, 32003):
        for case in ("random", "tie", "nan", "all-inf"):
            row = torch.randn(n, generator=gen)
            if case == "tie" and n > 2:
                row[n // 3] = row[n - 1] = 9.0
            elif case == "nan":
                row[n // 2] = float("nan")
            elif case == "all-inf":
                row[:] = float("-inf")
            assert fn(row.data_ptr(), n) == int(row.argmax()), (n, case)


def _all_bf16_gates(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite and infinite bf16 value as a gate, each beside a random up value."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = gate[~torch.isnan(gate.float())]
    return gate, (torch.randn(gate.numel(), generator=gen) * 3).to(torch.bfloat16)


def _silu_rows(gate: torch.Tensor, up: torch.Tensor, inter: int) -> torch.Tensor:
    """Rows [gate | up] of ``inter`` values each (the tail of ``gate`` that fills no row is
    left out)."""
    rows = gate.numel() // inter
    n = rows * inter
    return torch.cat([gate[:n].view(rows, inter), up[:n].view(rows, inter)], 1).contiguous()


def test_silu_mul_takes_its_own_loop_with_atens_bits_for_every_bf16_value() -> None:
    """``tpserve::silu_mul`` runs silu_mul.c (not ATen's two calls) for bf16 where ATen's
    vector width matches the build, and gives ATen's bits for every bf16 gate: in the
    vector blocks (rows of 1408) and in the scalar tail (rows of 63, shorter than a block)."""
    lanes = silu_library()[1]
    if lanes == 0:
        pytest.skip("this build has no vector silu_mul (no AVX2 / AVX-512)")
    aten = torch.backends.cpu.get_cpu_capability()
    if aten not in ("AVX2", "AVX512") or {"AVX2": 8, "AVX512": 16}[aten] != lanes:
        pytest.skip(f"ATen runs its {aten} kernels here, another width than this build's")
    gate, up = _all_bf16_gates(torch.Generator().manual_seed(5))
    for inter in (1408, 63, 176):
        x = _silu_rows(gate, up, inter)
        assert torch.ops.tpserve.silu_mul_native(x), inter
        got, want = torch.ops.tpserve.silu_mul(x), fused.silu_mul_reference(x)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), inter
    assert not torch.ops.tpserve.silu_mul_native(x.float())  # other dtypes stay ATen's


def silu_library(*flags: str) -> tuple[ctypes.CDLL, int]:
    """silu_mul.c built alone (``flags`` after the usual ones), linked to libtorch_cpu for the
    Sleef exp it calls; (library, lanes)."""
    here = Path(fused.__file__).parent
    lib_dir = Path(torch.__file__).parent / "lib"
    return load_library(here / "silu_mul.c", "silu_mul_lanes", (here / "half.h",), flags,
                        (f"-L{lib_dir}", "-ltorch_cpu", "-lc10"))


_SILU_AVX2_CHECK = r"""
import ctypes, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.test_fused_ops import _all_bf16_gates, _silu_rows, silu_library
from tpserve.layers import fused
assert torch.backends.cpu.get_cpu_capability() == "AVX2"
lib, lanes = silu_library("-mno-avx512f")
assert lanes == 8
gate, up = _all_bf16_gates(torch.Generator().manual_seed(5))
for inter in (1408, 31, 176):
    x = _silu_rows(gate, up, inter)
    out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
    lib.silu_mul_bf16(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[0]),
                      ctypes.c_int64(inter), ctypes.c_void_p(out.data_ptr()))
    want = fused.silu_mul_reference(x)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16)), inter
print("ok")
"""


def test_silu_mul_avx2_build_matches_atens_avx2_kernels() -> None:
    """The AVX2 path of silu_mul.c (built alone) against ATen running its AVX2 kernels
    (ATEN_CPU_CAPABILITY=avx2, in a child process: ATen reads it once), every bf16 gate."""
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    run = subprocess.run([sys.executable, "-c", _SILU_AVX2_CHECK, str(root)], env=env,
                         capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
