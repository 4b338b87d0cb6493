"""The ``cuda_p2p`` kernel source compiles with NVRTC, as ``cupy.RawModule`` compiles it on a GPU
machine, for every GPU generation the backend accepts, and every kernel name resolves.

NVRTC needs no GPU, so this runs on CPU-only CI (NVRTC comes from the ``nvidia-cuda-nvrtc-cu12``
wheel, a test dependency): without it a typo in the kernels would first show on a GPU host.
Blackwell (compute_100 datacenter, compute_120 consumer/workstation) needs NVRTC 12.8 or newer;
an older NVRTC skips those with the reason (12.9.86 is what CI installs, and has both).
CUDA 13's wheel (``nvidia-cuda-nvrtc``, what cupy-cuda13x uses) keeps the library under
``nvidia/cu13/lib``; it is found there too, so a CUDA 13 machine checks its own NVRTC.

On a GPU it knows, cupy asks NVRTC for a cubin (``-arch=sm_XX``), which runs ptxas inside
NVRTC: the real-architecture cases check that step too, not only the PTX.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from pathlib import Path

import pytest

from comm_backends.cuda_p2p_kernels import KERNELS, SOURCE

# cuda_p2p needs acquire/release loads and stores: compute capability 7.0 and up (CUDA 13's
# NVRTC starts at 7.5: it skips compute_70 with the reason).
ARCHS = ("compute_70", "compute_80", "compute_90", "compute_100", "compute_120")
# Real architectures, compiled to a cubin as cupy does for the GPU it runs on (H100/H200: 90).
SM_ARCHS = ("sm_75", "sm_80", "sm_90", "sm_100", "sm_120")
# Where the NVRTC wheels put the library: CUDA 12's nvidia-cuda-nvrtc-cu12, CUDA 13's
# nvidia-cuda-nvrtc (one lib folder shared by every CUDA 13 component wheel).
_WHEEL_PACKAGES = ("nvidia.cuda_nvrtc", "nvidia.cu13")


def _nvrtc_path() -> str | None:
    for package in _WHEEL_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except ModuleNotFoundError:  # no nvidia namespace package at all
            spec = None
        if spec is not None and spec.submodule_search_locations:
            for root in spec.submodule_search_locations:
                found = sorted(Path(root, "lib").glob("libnvrtc.so*"))
                if found:
                    return str(found[0])
    return ctypes.util.find_library("nvrtc")


def _compile(lib: ctypes.CDLL, source: str, arch: str) -> tuple[int, str, str, dict[str, str]]:
    """(status, log, ptx, {kernel: lowered name}) of one NVRTC compilation."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"cuda_p2p.cu", 0, None, None) == 0
    try:
        for name in KERNELS:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        options = [b"--std=c++14", f"--gpu-architecture={arch}".encode()]  # as cuda_p2p passes
        status = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx, lowered = "", {}
        if status == 0:
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx = buf.value.decode()
            for name in KERNELS:
                low = ctypes.c_char_p()
                assert lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(low)) == 0
                lowered[name] = low.value.decode()
        return status, log.value.decode(errors="replace"), ptx, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.fixture(scope="module")
def nvrtc() -> ctypes.CDLL:
    path = _nvrtc_path()
    if path is None:
        pytest.skip("NVRTC not installed (pip install nvidia-cuda-nvrtc-cu12)")
    return ctypes.CDLL(path)


def _supported(lib: ctypes.CDLL) -> tuple[set[int], str]:
    """The SM numbers this NVRTC compiles for, and its version."""
    major, minor, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    assert lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)) == 0
    archs = (ctypes.c_int * count.value)()
    assert lib.nvrtcGetSupportedArchs(archs) == 0
    return set(archs), f"{major.value}.{minor.value}"


@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_compile_and_every_name_resolves(nvrtc: ctypes.CDLL, arch: str) -> None:
    supported, version = _supported(nvrtc)
    if int(arch.split("_")[1]) not in supported:
        pytest.skip(f"NVRTC {version} cannot target {arch} (Blackwell needs 12.8+)")
    status, log, ptx, lowered = _compile(nvrtc, SOURCE, arch)
    assert status == 0, log
    assert set(lowered) == set(KERNELS)
    for name, symbol in lowered.items():
        assert f".entry {symbol}(" in ptx, name
    # The flag protocol's system-scope release/acquire made it through as written, and the
    # spin is bounded by the global timer.
    assert "st.release.sys.global.u32" in ptx and "ld.acquire.sys.global.u32" in ptx
    assert "%globaltimer" in ptx
    for name, symbol in lowered.items():  # every kernel takes its spin limit
        params = ptx.split(f".entry {symbol}(", 1)[1].split(")", 1)[0]
        assert params.count(".param") == 6, (name, params)


def _cubin_size(lib: ctypes.CDLL, source: str, arch: str) -> tuple[int, str, int]:
    """(status, log, cubin bytes) of one NVRTC compilation for a real architecture."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"cuda_p2p.cu", 0, None, None) == 0
    try:
        for name in KERNELS:
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        options = [b"--std=c++14", f"--gpu-architecture={arch}".encode()]
        status = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        cubin = ctypes.c_size_t()
        if status == 0:
            assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)) == 0
        return status, log.value.decode(errors="replace"), cubin.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", SM_ARCHS)
def test_kernels_assemble_to_a_cubin(nvrtc: ctypes.CDLL, arch: str) -> None:
    supported, version = _supported(nvrtc)
    if int(arch.split("_")[1]) not in supported:
        pytest.skip(f"NVRTC {version} cannot target {arch}")
    status, log, cubin = _cubin_size(nvrtc, SOURCE, arch)
    assert status == 0, log
    assert cubin > 0


def test_nvrtc_is_found_in_either_wheel_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA 13's wheel layout (nvidia/cu13/lib) is searched, not only CUDA 12's."""
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc.so.13").write_bytes(b"")
    (lib / "libnvrtc-builtins.so.13.0").write_bytes(b"")

    class Spec:
        submodule_search_locations = [str(tmp_path / "nvidia" / "cu13")]

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: Spec() if name == "nvidia.cu13" else None)
    assert _nvrtc_path() == str(lib / "libnvrtc.so.13")


def test_the_installed_nvrtc_targets_blackwell(nvrtc: ctypes.CDLL) -> None:
    """CI's NVRTC must cover the GPUs users run (sm_100, sm_120), or the skips above hide it."""
    supported, version = _supported(nvrtc)
    assert {100, 120} <= supported, f"NVRTC {version} lacks Blackwell: upgrade nvidia-cuda-nvrtc-cu12"


def test_a_broken_source_is_reported(nvrtc: ctypes.CDLL) -> None:
    """The harness itself can fail: a kernel that does not compile gives a status and a log."""
    status, log, _, _ = _compile(nvrtc, SOURCE.replace("reduce_pack<E>(t, world, p)", "reduce_pack<E>(t)", 1),
                                 "compute_80")
    assert status != 0 and "reduce_pack" in log
