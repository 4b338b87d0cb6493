"""Attention backends on CUDA: FlashInfer and the torch fallback against the float64 reference.

Anywhere: the page-layout conversion, the lazy import, and the backend's glue run against
tests/fake_flashinfer.py (a CPU model of FlashInfer's documented semantics) on every scenario.
On a CUDA machine the real library runs; nothing skips there: a missing ``flashinfer-python``
fails (the ``gpu`` extra installs it), so these tests cannot pass by refusing.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from tests import fake_flashinfer
from tests.attention_cases import make_case, reference
from tests.test_attention_backends import SCENARIOS
from tpserve.layers.attention import create
from tpserve.layers.attention.flashinfer_backend import FlashInferAttention, paged_layout

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
GPU_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def test_flashinfer_module_imports_lazily() -> None:
    had = "flashinfer" in sys.modules
    importlib.import_module("tpserve.layers.attention.flashinfer_backend")
    assert ("flashinfer" in sys.modules) == had


def test_paged_layout() -> None:
    table = np.array([[7, 3, 9, 0], [5, 0, 0, 0], [2, 4, 0, 0]], dtype=np.int32)
    indptr, indices, last = paged_layout(table, np.array([33, 0, 16]), 16)
    assert indptr.tolist() == [0, 3, 3, 4]
    assert indices.tolist() == [7, 3, 9, 2]
    assert last.tolist() == [1, 0, 16]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_glue_against_a_model_of_flashinfer(scenario: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    case = make_case(12, heads=(8, 2), head_dim=64, **SCENARIOS[scenario])
    ref, k_ref, v_ref = reference(case)
    attn = FlashInferAttention(case.spec, torch.device("cpu"))
    cache = case.caches()
    out = attn.forward(case.q, case.k, case.v, cache, attn.prepare(case.metadata()))
    assert torch.equal(cache[0], k_ref) and torch.equal(cache[1], v_ref)
    assert (out.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.gpu
@needs_cuda
def test_flashinfer_is_installed() -> None:
    assert importlib.util.find_spec("flashinfer") is not None, "pip install 'tpserve[gpu]'"


def _check(backend: str, scenario: str, dtype: torch.dtype, head_dim: int) -> None:
    device = torch.device("cuda")
    case = make_case(11, heads=(8, 2), head_dim=head_dim, dtype=dtype, **SCENARIOS[scenario])
    ref, k_ref, v_ref = reference(case)
    attn = create(backend, case.spec, device)
    cache = case.caches(device)
    step = attn.prepare(case.metadata(device))
    q, k, v = (t.to(device) for t in (case.q, case.k, case.v))
    out = attn.forward(q, k, v, cache, step).cpu()
    assert torch.equal(cache[0].cpu(), k_ref) and torch.equal(cache[1].cpu(), v_ref)
    err = (out.double() - ref).abs()
    assert (err <= GPU_TOL[dtype] * (1 + ref.abs())).all(), (scenario, err.max().item())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_flashinfer_equals_float64(scenario: str, head_dim: int, dtype: torch.dtype) -> None:
    _check("flashinfer", scenario, dtype, head_dim)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torch_backend_on_cuda(scenario: str, dtype: torch.dtype) -> None:
    _check("torch", scenario, dtype, 64)


@pytest.mark.gpu
@needs_cuda
def test_auto_is_flashinfer_on_cuda() -> None:
    case = make_case(1, q_lens=[1], cached=[3], heads=(8, 2), head_dim=128, dtype=torch.bfloat16)
    assert create("auto", case.spec, torch.device("cuda")).name == "flashinfer"
