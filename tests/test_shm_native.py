"""The shm backend's compiled reduction (comm_backends/shm_reduce.c) against torch references.

The kernel must equal, bit for bit, a sequential fp32 accumulation over rows (row 0, 1, ...)
rounded once to the output dtype: for two rows that is exactly torch's own 16-bit add. Special
values (inf, NaN, subnormals, signed zeros) and lengths that are not a multiple of the vector
width (the scalar tail) are included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comm_backends import shm_native
from comm_backends.native_build import load_library

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (1, 7, 15, 16, 17, 33, 1000, 4099)


def _avx2_build() -> shm_native.NativeReduce:
    """The 8-lane AVX2 + F16C path (CPUs without AVX-512), built from the same sources."""
    if " avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    lib, lanes = load_library(shm_native.SOURCE, "reduce_lanes", shm_native.DEPENDS, ("-mno-avx512f",))
    assert lanes == 8
    return shm_native.bind_library(lib)


@pytest.fixture(scope="module", params=["native", "avx2"])
def native(request: pytest.FixtureRequest) -> shm_native.NativeReduce:
    if request.param == "avx2":
        return _avx2_build()
    kernel = shm_native.load()
    # CI and every supported host (x86-64 with AVX2) have a C compiler: a None here means the
    # backend silently lost its fast path, which is a failure, not a skip.
    assert kernel is not None, "the compiled shm reduction did not build on this machine"
    return kernel


def _rows(count: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(count, n, generator=gen, dtype=torch.float64) * 50
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0,
                             torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 8, 1e-3])
    take = min(n, specials.numel())
    rows[count - 1, :take] = specials[:take].double()  # one row carries the special values
    # ... again one element later, so that each lands on both even and odd positions (bf16
    # sums even and odd elements in separate registers); inf + -inf makes a NaN on both.
    take = min(n - take - 1, specials.numel())
    if take > 0:
        rows[count - 1, specials.numel() + 1 : specials.numel() + 1 + take] = specials[:take].double()
        rows[0, specials.numel() + 1 : specials.numel() + 3] = torch.tensor([float("-inf"), float("inf")])
    return rows.to(dtype)


def _sequential_reference(rows: torch.Tensor) -> torch.Tensor:
    acc = rows[0].float().clone()
    for row in rows[1:]:
        acc += row.float()
    return acc.to(rows.dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (payloads are not specified)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan_a].view(bits), b[~nan_b].view(bits))


def _run(native: shm_native.NativeReduce, rows: torch.Tensor) -> torch.Tensor:
    out, out2 = torch.empty(rows.shape[1], dtype=rows.dtype), torch.empty(rows.shape[1], dtype=rows.dtype)
    pointers = shm_native.row_pointers([row.data_ptr() for row in rows])
    native(pointers, rows.shape[0], out.data_ptr(), out2.data_ptr(), rows.shape[1], rows.dtype)
    assert _same(out, out2)  # the second output gets the same bits
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_two_rows_equal_torch_add(native: shm_native.NativeReduce, dtype: torch.dtype, n: int) -> None:
    rows = _rows(2, n, dtype, seed=n)
    assert _same(_run(native, rows), torch.add(rows[0], rows[1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", (3, 4, 8))
def test_many_rows_equal_sequential_fp32_accumulation(
    native: shm_native.NativeReduce, dtype: torch.dtype, count: int
) -> None:
    for n in LENGTHS:
        rows = _rows(count, n, dtype, seed=100 * count + n)
        assert _same(_run(native, rows), _sequential_reference(rows)), (dtype, count, n)


def test_strided_rows_and_rounding_ties(native: shm_native.NativeReduce) -> None:
    """Rows with a gap between them (the shm slot layout), and sums that land exactly on a tie."""
    base = torch.zeros(3, 64, dtype=torch.bfloat16)
    rows = base[:, :37]  # row stride 64 elements, length 37
    # bf16 keeps 7 mantissa bits: (1 + 2^-7) + 2^-8 lies halfway between 1 + 2^-7 (odd last
    # bit) and 1 + 2^-6 (even); round-to-nearest-even must pick the latter, truncation the former.
    rows[0] = 1.0 + 2.0**-7
    rows[1] = 2.0**-8
    out = _run(native, rows[:2])
    assert torch.equal(out, torch.full((37,), 1.0 + 2.0**-6, dtype=torch.bfloat16))
    assert _same(out, torch.add(rows[0], rows[1]))


def test_in_place_into_one_of_the_rows(native: shm_native.NativeReduce) -> None:
    """Two-shot sums a rank's own segment straight into its input tensor."""
    for dtype in DTYPES:
        rows = _rows(3, 1001, dtype, seed=5)
        expected = _sequential_reference(rows)
        pointers = shm_native.row_pointers([row.data_ptr() for row in rows])
        native(pointers, 3, rows[1].data_ptr(), None, rows.shape[1], dtype)
        assert _same(rows[1], expected), dtype


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPSERVE_SHM_NATIVE", "0")
    shm_native.load.cache_clear()
    try:
        assert shm_native.load() is None
    finally:
        shm_native.load.cache_clear()


def test_unwritable_cache_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TPSERVE_CACHE", str(blocker / "cache"))  # mkdir fails, even as root
    shm_native.load.cache_clear()
    try:
        assert shm_native.load() is None
    finally:
        shm_native.load.cache_clear()
