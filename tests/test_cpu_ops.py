"""tpserve's dispatcher ops (tpserve/layers/cpu_ops.cpp + gemm.c) against references.

- ``tpserve::matmul(x, w)`` (x @ w^T) with 16-bit weights runs our kernel on its thread pool:
  within one ulp of the float64 product (fp32 accumulation, one rounding), NaN / inf /
  subnormals kept, any row count, column tail and row stride; and an output gets the same
  bits whatever other rows are in the call and however many threads run it (plain decode and
  a verify batch must agree, as must eager and compiled decode).
- Everywhere else (fp32 weights, ``TPSERVE_NATIVE_GEMM=0``) it is what ran before, bit for
  bit: ``torch.mv`` for one row, ``F.linear`` for more.
- ``tpserve::mean_square`` of contiguous fp32 CPU rows (up to 64 rows, or any number on one
  thread) is within one fp32 rounding of the float64 value; other inputs get ATen's pow + mean.
- The C++ library must build here (CI has g++): falling back to Python ops silently would
  lose the decode speed, so that is a failure, not a skip. The fallback itself is tested in a
  subprocess.
"""

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
from launch.machine import machine_info
from tpserve.layers import cpu_ops

OUT = (1, 3, 4, 5, 17, 64)  # weight rows: the 4-row and 2-row tiles and their remainders
COLS = (1, 7, 31, 32, 33, 100, 512, 1408)  # vector blocks of 32 (AVX-512) and the scalar tail
# x rows: one row, blocks of 4 (2-row tiles) and their 1-3 row remainders, decode batches
XROWS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    cpu_ops.load()  # what every model layer does before it runs
    before = torch.get_num_threads(), torch.ops.tpserve.matmul_threads()
    torch.set_num_threads(1)
    cpu_ops.set_matmul_threads(1)
    yield
    torch.set_num_threads(before[0])
    cpu_ops.set_matmul_threads(before[1])


def test_the_cpp_ops_build_here() -> None:
    loaded = cpu_ops.load()
    assert loaded.impl == "c++", loaded.reason
    assert torch.ops.tpserve.gemm_lanes() in (8, 16)


def test_thread_count_is_process_state() -> None:
    assert cpu_ops.set_matmul_threads(3) == 3 and torch.ops.tpserve.matmul_threads() == 3
    assert cpu_ops.set_matmul_threads(0) == 1  # never zero
    assert torch.ops.tpserve.matmul_threads() == 1


def _ulp(y: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each value of a 16-bit tensor (as float64)."""
    bits = {torch.bfloat16: 8, torch.float16: 11}[y.dtype]
    tiny = torch.finfo(y.dtype).tiny
    mag = y.double().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - (bits - 1))


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst-case error of the kernel's sum: the output's final rounding (one ulp of the exact
    value covers half an ulp either side of a boundary) plus fp32 summation error, which is at
    most depth * 2^-24 * sum |w x| for a summation tree of that depth (per lane: one add per
    32-column block; then the two halves, four tree levels, and the tail columns)."""
    cols = x.shape[1]
    depth = cols // 32 + 1 + 4 + cols % 32
    ref = x.double() @ w.double().T
    return _ulp(ref.to(x.dtype)) + depth * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out", OUT)
@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("m", XROWS)
def test_within_one_ulp_of_float64(dtype: torch.dtype, out: int, cols: int, m: int) -> None:
    gen = torch.Generator().manual_seed(out * 10000 + cols * 10 + m)
    w = torch.randn(out, cols, generator=gen).to(dtype)
    x = torch.randn(m, cols, generator=gen).to(dtype)
    y = torch.ops.tpserve.matmul(x, w)
    assert y.dtype == dtype and y.shape == (m, out)
    assert ((y.double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_row_gets_the_same_bits_in_any_call(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(37, 515, generator=gen).to(dtype)
    x = torch.randn(17, 515, generator=gen).to(dtype)
    full = torch.ops.tpserve.matmul(x, w)
    for i in range(17):  # x rows alone vs in a batch of 17 (AVX2 and AVX-512: 6, 6, 5)
        assert torch.equal(torch.ops.tpserve.matmul(x[i:i + 1], w), full[i:i + 1])
    for i, n in [(0, 2), (1, 3), (5, 5), (3, 9)]:  # blocks of 2 and 3 rows, other groupings
        assert torch.equal(torch.ops.tpserve.matmul(x[i:i + n], w), full[i:i + n])
    for start in range(37):  # weight rows in 4-row and 2-row tiles vs alone
        for size in (1, 2, 3, 5):
            for rows in (1, 3, 4):
                part = torch.ops.tpserve.matmul(x[:rows], w[start:start + size])
                assert torch.equal(part, full[:rows, start:start + size])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4, 16, 33])
def test_any_thread_count_gives_the_same_bits(dtype: torch.dtype, m: int) -> None:
    """Threads take chunks of weight rows in whatever order they get to them: the chunking
    changes with the count and the schedule, the bits must not (eager vs compiled, a server
    with --cpu-threads 1 vs 2)."""
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(1037, 700, generator=gen).to(dtype)  # many chunks, odd sizes
    x = torch.randn(m, 700, generator=gen).to(dtype)
    one = torch.ops.tpserve.matmul(x, w)
    for threads in (2, 3, 4):
        cpu_ops.set_matmul_threads(threads)
        for _ in range(3):
            assert torch.equal(torch.ops.tpserve.matmul(x, w), one)
    assert ((one.double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()


def test_the_pool_is_shared_by_python_threads() -> None:
    """Two Python threads calling at once: one runs on the pool, the other alone; both right."""
    from concurrent.futures import ThreadPoolExecutor

    cpu_ops.set_matmul_threads(2)
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(800, 256, generator=gen).bfloat16()
    xs = [torch.randn(3, 256, generator=gen).bfloat16() for _ in range(8)]
    expect = [torch.ops.tpserve.matmul(x, w) for x in xs]
    with ThreadPoolExecutor(4) as ex:
        for _ in range(5):
            got = list(ex.map(lambda x: torch.ops.tpserve.matmul(x, w), xs))
            assert all(torch.equal(g, e) for g, e in zip(got, expect, strict=True))


def test_strided_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(40, 700, generator=gen).bfloat16()
    w = big[3:30, 100:612]  # row stride 700, offset storage
    xs = torch.randn(5, 600, generator=gen).bfloat16()
    x = xs[:, 50:562]
    expect = torch.ops.tpserve.matmul(x.contiguous(), w.contiguous())
    assert torch.equal(torch.ops.tpserve.matmul(x, w), expect)


def test_special_values() -> None:
    w = torch.ones(6, 40, dtype=torch.bfloat16)
    x = torch.ones(1, 40, dtype=torch.bfloat16)
    w[0, 5] = float("nan")
    w[1, 39] = float("inf")  # in the scalar tail
    w[2, 0] = float("-inf")
    w[3, :] = 0
    sub = torch.finfo(torch.bfloat16).tiny / 8  # a bf16 subnormal
    w[4, :] = 0
    w[4, 1] = sub
    w[5, 2], w[5, 3] = float("inf"), float("-inf")
    y = torch.ops.tpserve.matmul(x, w)[0].float()
    assert torch.isnan(y[0]) and y[1] == float("inf") and y[2] == float("-inf")
    # AVX512-BF16's dot product counts bf16 subnormal inputs as zero; the FMA tiles keep them
    kept = 0.0 if _bf16_dot(_gemm_build()[0]) else torch.tensor(sub, dtype=torch.bfloat16).float()
    assert y[3] == 0 and y[4] == kept
    assert torch.isnan(y[5])


def test_rounding_is_nearest_even() -> None:
    # 1 + 2^-8 lies halfway between the bf16 values 1 and 1 + 2^-7: the tie goes to the even
    # mantissa, 1. 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: it goes to 1 + 2^-6.
    w = torch.tensor([[1.0, 2.0 ** -8], [1.0, 3 * 2.0 ** -8]], dtype=torch.bfloat16)
    y = torch.ops.tpserve.matmul(torch.ones(1, 2, dtype=torch.bfloat16), w)
    assert y[0].tolist() == [1.0, 1.0 + 2.0 ** -6]


@pytest.mark.parametrize("m", [1, 4])
def test_outside_the_kernel_it_is_aten(m: int) -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(300, 517, generator=gen)  # fp32 weights: no native path
    x = torch.randn(m, 517, generator=gen)
    expect = torch.mv(w, x[0])[None] if m == 1 else torch.nn.functional.linear(x, w)
    assert torch.equal(torch.ops.tpserve.matmul(x, w), expect)


def test_mean_square_within_an_ulp_of_float64_on_any_thread_count() -> None:
    x = torch.randn(37, 4099, generator=torch.Generator().manual_seed(5)) * 30
    x[3, :5] = torch.tensor([1e18, -1e18, 0.0, 1e-40, 3.0])  # large, zero, subnormal
    ref = x.double().pow(2).mean(-1, keepdim=True)
    y = torch.ops.tpserve.mean_square(x)
    assert y.shape == (37, 1) and y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= ref * 2.0 ** -24).all()  # one rounding of fp64
    torch.set_num_threads(2)
    assert torch.equal(torch.ops.tpserve.mean_square(x), y)
    for n in (1, 7, 8, 9, 512):
        row = x[:2, :n].contiguous()
        ref_n = row.double().pow(2).mean(-1, keepdim=True)
        assert ((torch.ops.tpserve.mean_square(row).double() - ref_n).abs() <= ref_n * 2.0 ** -24).all()


@pytest.mark.parametrize("case", ["strided", "bf16", "many rows on two threads"])
def test_mean_square_outside_the_loop_is_aten(case: str) -> None:
    x = torch.randn(65, 300, generator=torch.Generator().manual_seed(9))
    if case == "strided":
        x = x[:, ::2]
    elif case == "bf16":
        x = x.bfloat16()
    else:
        torch.set_num_threads(2)
    assert torch.equal(torch.ops.tpserve.mean_square(x), x.pow(2).mean(-1, keepdim=True))


_FALLBACK = """
import torch
from tpserve.layers import cpu_ops
from tpserve.layers.linear import linear
torch.set_num_threads(1)
loaded = cpu_ops.load()
threads = cpu_ops.set_matmul_threads(2)
w = torch.randn(33, 129).bfloat16(); x = torch.randn(3, 129).bfloat16()
assert torch.equal(torch.ops.tpserve.matmul(x[:1], w), torch.mv(w, x[0])[None])
assert torch.equal(torch.ops.tpserve.matmul(x, w), torch.nn.functional.linear(x, w))
assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
x32 = torch.randn(3, 77)
assert torch.allclose(torch.ops.tpserve.mean_square(x32), x32.pow(2).mean(-1, keepdim=True),
                      rtol=1e-6, atol=0)
print(loaded.impl, threads, torch.ops.tpserve.gemm_lanes())
"""


@pytest.mark.parametrize(("env", "value", "expected"), [
    ("TPSERVE_CPU_OPS", "0", "python 1 0"),  # no pool without the C++ ops
    ("TPSERVE_NATIVE_GEMM", "0", "c++ 2 0"),
    ("TPSERVE_CACHE", "/dev/null/cache", "python 1 0"),  # unwritable: a build failure, not a crash
])
def test_switches_fall_back_to_torch(env: str, value: str, expected: str) -> None:
    out = subprocess.run([sys.executable, "-c", _FALLBACK], env={**os.environ, env: value},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == expected.split()


_FORK = """
import os, torch
from tpserve.layers import cpu_ops
cpu_ops.load()
cpu_ops.set_matmul_threads(2)
w = torch.randn(999, 300).bfloat16(); x = torch.randn(5, 300).bfloat16()
y = torch.ops.tpserve.matmul(x, w)  # the parent's helper thread is running now
pid = os.fork()
if pid == 0:  # the child has no helpers: they start again, and the bits are the same
    os._exit(0 if torch.equal(torch.ops.tpserve.matmul(x, w), y) else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
assert torch.equal(torch.ops.tpserve.matmul(x, w), y)
print("ok")
"""


def test_the_pool_survives_fork() -> None:
    out = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["ok"], out.stderr


def test_linear_routes_cpu_rows_through_the_op() -> None:
    """At any row count (one kernel, so a row's bits do not depend on its batch)."""
    from tpserve.layers.linear import linear

    gen = torch.Generator().manual_seed(17)
    w = torch.randn(70, 224, generator=gen).bfloat16()
    bias = torch.randn(70, generator=gen).bfloat16()
    x = torch.randn(300, 224, generator=gen).bfloat16()
    full = linear(x, w, bias)
    assert torch.equal(full, torch.ops.tpserve.matmul(x, w) + bias)
    for m in (1, 8, 9, 17, 64):
        assert torch.equal(linear(x[-m:], w, bias), full[-m:])


def _ctypes_gemm(lib: ctypes.CDLL, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    fn = lib.gemm_bf16 if dtype == torch.bfloat16 else lib.gemm_f16
    fn.restype = ctypes.c_int32
    fn.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
    return fn


def _gemm_build(*flags: str) -> tuple[ctypes.CDLL, int]:
    """gemm.c alone through ctypes, with ``flags`` after the usual ones; (library, lanes)."""
    source = Path(cpu_ops.__file__).with_name("gemm.c")
    depends = [source.with_name(n)
               for n in ("gemm_tiles.c", "gemm_amx.c", "gemm_pool.c", "pool_readahead.c", "half.h")]
    return load_library(source, "gemm_lanes", depends, extra_flags=flags)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_avx2_build_within_one_ulp_on_any_thread_count(dtype: torch.dtype) -> None:
    """The 8-lane AVX2 path (CPUs without AVX-512), built from the same gemm.c via ctypes."""
    lib, lanes = _gemm_build("-mno-avx512f")
    assert lanes == 8
    fn = _ctypes_gemm(lib, dtype)
    gen = torch.Generator().manual_seed(13)
    for m, rows, cols in [(1, 5, 7), (3, 17, 33), (9, 64, 1408), (17, 301, 100), (64, 130, 515)]:
        w = torch.randn(rows, cols, generator=gen).to(dtype)
        x = torch.randn(m, cols, generator=gen).to(dtype)
        ys = []
        for threads in (1, 2, 3):
            assert lib.gemm_set_threads(threads) == threads
            y = torch.empty(m, rows, dtype=dtype)
            assert fn(w.data_ptr(), cols, x.data_ptr(), cols, m, rows, cols, y.data_ptr(), rows) == 0
            ys.append(y)
        assert ((ys[0].double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()
        assert all(torch.equal(y, ys[0]) for y in ys)
        # and the AVX2 tiles within a row sum in the same order per lane count: a row alone
        # matches the row in the batch
        y1 = torch.empty(1, rows, dtype=dtype)
        fn(w.data_ptr(), cols, x[-1:].contiguous().data_ptr(), cols, 1, rows, cols, y1.data_ptr(), rows)
        assert torch.equal(y1, ys[0][-1:])
    lib.gemm_set_threads(1)


@pytest.mark.skipif(not torch.cpu._is_avx512_supported(), reason="needs AVX-512")
def test_avx512_stream_rows_give_the_same_bits() -> None:
    """One weight row per pass (any AMD Zen) or four (other AVX-512 CPUs) at one x row: the
    same outputs bit for bit, at any thread count, as each output's sum is the same."""
    builds = [_gemm_build(f"-DROWS={r}") for r in (1, 4)]
    assert [lanes for _, lanes in builds] == [16, 16]
    gen = torch.Generator().manual_seed(5)
    for rows, cols in [(5, 7), (17, 33), (301, 1408), (130, 515)]:
        w = torch.randn(rows, cols, generator=gen).bfloat16()
        x = torch.randn(1, cols, generator=gen).bfloat16()
        ys = []
        for lib, _ in builds:
            fn = _ctypes_gemm(lib, torch.bfloat16)
            for threads in (1, 2):
                lib.gemm_set_threads(threads)
                y = torch.empty(1, rows, dtype=torch.bfloat16)
                assert fn(w.data_ptr(), cols, x.data_ptr(), cols, 1, rows, cols, y.data_ptr(),
                          rows) == 0
                ys.append(y)
            lib.gemm_set_threads(1)
        assert ((ys[0].double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()
        assert all(torch.equal(y, ys[0]) for y in ys)


def test_pool_claims_from_both_ends_and_reads_ahead_without_changing_bits() -> None:
    """Helper 0 claims chunks from the end of each job and prefetches the chunks of the jobs it
    predicts will follow (gemm_pool.c, pool_readahead.c): every chunk is still computed once,
    with the same bits as one thread, on or off; and once the weights it learnt are freed
    (their pages unmapped), reading ahead along the stale chain must not fault."""
    lib, _ = _gemm_build()
    fn = _ctypes_gemm(lib, torch.bfloat16)
    gen = torch.Generator().manual_seed(21)

    def step(ws: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        ys = []
        for w in ws:
            rows, cols = w.shape
            y = torch.full((x.shape[0], rows), float("nan"), dtype=torch.bfloat16)
            assert fn(w.data_ptr(), cols, x.data_ptr(), cols, x.shape[0], rows, cols,
                      y.data_ptr(), rows) == 0
            ys.append(y)
        return ys

    # a decode step's shapes: fused qkv, o, gate_up, down, and a head, twice (the chain)
    shapes = [(1024, 512), (512, 512), (2816, 512), (512, 1408)] * 2 + [(4000, 512)]
    for _round in range(2):
        ws = [torch.randn(r, c, generator=gen).bfloat16() for r, c in shapes]
        for m in (1, 3):
            xs = {c: torch.randn(m, c, generator=gen).bfloat16() for c in (512, 1408)}
            steps = [(w, xs[w.shape[1]]) for w in ws]
            lib.gemm_set_threads(1)
            want = [step([w], x)[0] for w, x in steps]
            for threads, ends in [(2, 1), (3, 1), (2, 0), (2, 1)]:
                lib.gemm_set_threads(threads)
                assert lib.gemm_set_ends(ends) == ends
                for _ in range(3):  # the chain is learnt in the first, read ahead in the rest
                    got = [step([w], x)[0] for w, x in steps]
                    assert all(torch.equal(g, e) for g, e in zip(got, want))
            for (w, x), y in zip(steps, want):
                assert ((y.double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()
        del ws, steps  # the next round's chain starts from freed buffers
    lib.gemm_set_threads(1)


def _ctypes_matmul(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor, threads: int
                   ) -> torch.Tensor:
    """x @ w^T (bf16, contiguous) by a ctypes build on ``threads`` pool threads."""
    (m, cols), rows = x.shape, w.shape[0]
    lib.gemm_set_threads(threads)
    y = torch.empty(m, rows, dtype=torch.bfloat16)
    assert _ctypes_gemm(lib, torch.bfloat16)(w.data_ptr(), cols, x.data_ptr(), cols, m, rows,
                                             cols, y.data_ptr(), rows) == 0
    lib.gemm_set_threads(1)
    return y


def _bf16_dot(lib: ctypes.CDLL) -> bool:
    return bool(lib.gemm_bf16_dot())


@pytest.mark.skipif("avx512_bf16" not in machine_info()["flags"], reason="needs AVX512-BF16")
def test_bf16_dot_tiles_within_bound_and_the_same_bits_whatever_the_tile() -> None:
    """AVX512-BF16 tiles (the default build here) and the FMA tiles (-DDPBF16=0): each within
    the float64 bound; the dot-product builds, whichever tiles the first x block may use
    (COLD_PAIRS, PAIR_XS, XPAIR), give the same bits at any thread count, and a row alone
    equals the row in the batch."""
    dot = {name: _gemm_build("-DAMX_TILES=0", *flags)[0] for name, flags in (
        ("default", ()), ("cold pairs", ("-DCOLD_PAIRS=1",)), ("no pairs", ("-DPAIR_XS=1",)),
        ("2 x 4 tiles", ("-DXPAIR=4",)))}
    fma = _gemm_build("-DDPBF16=0")[0]
    assert all(_bf16_dot(lib) for lib in dot.values()) and not _bf16_dot(fma)
    gen = torch.Generator().manual_seed(21)
    for m, rows, cols in [(1, 5, 7), (2, 40, 96), (3, 17, 33), (9, 64, 1408), (17, 301, 100),
                          (64, 130, 515)]:
        w = torch.randn(rows, cols, generator=gen).bfloat16()
        x = torch.randn(m, cols, generator=gen).bfloat16()
        ys = [_ctypes_matmul(lib, x, w, t) for lib in dot.values() for t in (1, 2)]
        assert all(torch.equal(y, ys[0]) for y in ys), (m, rows, cols)
        assert torch.equal(_ctypes_matmul(dot["default"], x[-1:].contiguous(), w, 2), ys[0][-1:])
        for y in (ys[0], _ctypes_matmul(fma, x, w, 2)):
            assert ((y.double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()


def _amx_build(*flags: str) -> ctypes.CDLL:
    lib = _gemm_build(*flags)[0]
    if not lib.gemm_amx():
        pytest.skip("no AMX tiles here (CPU, compiler or kernel)")
    return lib


def test_amx_tiles_within_bound_and_each_row_the_same_at_any_batch() -> None:
    """gemm_amx.c: every output within the float64 bound; a row's bits the same whatever x rows
    share its call (1 to 40, one x block or several, the 2 x 2 squares and the streaming
    loop), at any thread count, and in the builds that block the weight rows differently;
    rows past the last whole 16-row block and k not a multiple of 32 take the AVX512-BF16
    tiles at every row count."""
    libs = [_amx_build(), _amx_build("-DAMX_SQUARE=0"), _amx_build("-DAMX_STREAM=2", "-DAMX_GROUP=2"),
            _amx_build("-DAMX_AHEAD=0")]
    plain = _gemm_build("-DAMX_TILES=0")[0]
    gen = torch.Generator().manual_seed(31)
    for rows, cols in [(16, 32), (40, 96), (301, 512), (64, 1408), (130, 100)]:
        w = torch.randn(rows, cols, generator=gen).bfloat16()
        x = torch.randn(70, cols, generator=gen).bfloat16()
        full = _ctypes_matmul(libs[0], x, w, 2)
        assert ((full.double() - x.double() @ w.double().T).abs() <= _bound(x, w)).all()
        for lib in libs:
            for threads in (1, 3):
                assert torch.equal(_ctypes_matmul(lib, x, w, threads), full), (rows, cols)
        for m in (1, 2, 15, 16, 17, 33, 40):
            assert torch.equal(_ctypes_matmul(libs[0], x[-m:].contiguous(), w, 2), full[-m:])
        tail = rows % 16 if cols % 32 == 0 else rows  # what the AVX512-BF16 tiles compute
        if tail:
            assert torch.equal(full[:, rows - tail:], _ctypes_matmul(plain, x, w, 2)[:, rows - tail:])
