"""CUDA-graph replay equals eager decoding (GPU only; skipped without CUDA).

Every batch bucket is exercised by running exactly that many requests; with speculation the
draft-step and verify graphs replay too; and capture goes through each capture-safe
allreduce backend at world size 1 (where the reduction is the identity but the call path
is the captured one).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import comm_backends
from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tests.spec_helpers import args_for
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BUCKETS = (1, 2, 3, 4, 8)
GPU = dict(device="cuda", allreduce="nccl", max_total_tokens=8192, cuda_graph_bs=BUCKETS)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("graphs")
    target = make_checkpoint(root / "target", "llama", layers=4, hidden=64, vocab=32)
    return target, make_draft(root / "mimic", target, mimic=True)


def run(target: Path, draft: Path | None, n: int, setting: tuple[int, int, int] = (3, 2, 6),
        **kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    engine = OfflineEngine(args_for(target, draft, *setting, **{**GPU, **kw}))
    prompts = [[1] + [(5 * i + 3 * j) % 31 + 1 for j in range(2 + 2 * i)] for i in range(n)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    info = engine.built.runner.graph_info
    engine.close()
    return [o.output_ids for o in outs], info


@pytest.mark.parametrize("n", [*BUCKETS, 10])  # 10: above the largest bucket -> eager
def test_decode_graphs_match_eager(ckpts: tuple[Path, Path], n: int) -> None:
    target, _ = ckpts
    ref, info = run(target, None, n, disable_cuda_graph=True)
    assert info == {"kind": "eager"}
    out, info = run(target, None, n)
    assert out == ref
    spans = info["sets"]["decode"]["key_spans"]  # one with FlashInfer (it reads in place)
    assert info["sets"]["decode"]["graphs"] == len(BUCKETS) * len(spans)
    assert info["max_keys"] % 4 == 0 and spans[-1] == info["max_keys"]


@pytest.mark.parametrize("setting", [(3, 1, 4), (3, 2, 6)])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_spec_graphs_match_eager(ckpts: tuple[Path, Path], setting: tuple[int, int, int],
                                 n: int) -> None:
    target, draft = ckpts
    ref, _ = run(target, None, n, disable_cuda_graph=True)
    out, info = run(target, draft, n, setting)
    assert out == ref
    assert {"decode", "draft", "verify"} <= set(info["sets"])


@pytest.mark.parametrize("backend", ["nccl", "cuda_p2p", "symm_mem"])
def test_capture_through_backend(ckpts: tuple[Path, Path], backend: str) -> None:
    reason = comm_backends.unavailable_reason(backend, torch.device("cuda"), 1)
    if reason is not None:
        pytest.skip(reason)
    if not comm_backends.backend_class(backend).capture_safe:
        pytest.skip(f"allreduce backend '{backend}' does not declare capture_safe")
    target, draft = ckpts
    ref, _ = run(target, None, 3, disable_cuda_graph=True)
    out, info = run(target, draft, 3, allreduce=backend)
    assert out == ref
    assert info["allreduce"] == backend


@pytest.fixture(scope="module")
def fp16_ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """head_dim 64 in fp16: a model FlashInfer can run (the tiny fp32 one above cannot)."""
    root = tmp_path_factory.mktemp("fi_graphs")
    target = make_checkpoint(root / "target", "llama", layers=4, hidden=256, heads=4,
                             kv_heads=2, vocab=64, intermediate=256, dtype=torch.float16)
    return target, make_draft(root / "mimic", target, mimic=True)


def _generate(args: Any, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, Any]]:
    engine = OfflineEngine(args)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    info = engine.built.runner.graph_info
    engine.close()
    return [o.output_ids for o in outs], info


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("n", [3, 8])
def test_flashinfer_decode_graphs_match_eager(fp16_ckpts: tuple[Path, Path], n: int,
                                              speculative: bool) -> None:
    """Decode graphs replay FlashInfer's CUDA-graph decode (planned per step) over contexts of
    different lengths in one bucket; with speculation the draft/verify graphs use torch's
    gather under the same backend. Reference: eager FlashInfer, no graphs, no speculation."""
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed (tests/test_attention_gpu.py fails on it)")
    target, draft = fp16_ckpts
    prompts = [[1] + [(7 * i + 3 * j) % 61 + 1 for j in range(5 + 23 * i)] for i in range(n)]
    common = dict(attention_backend="flashinfer", dtype="float16")
    ref, info = _generate(args_for(target, None, **{**GPU, **common, "disable_cuda_graph": True}),
                          prompts)
    assert info == {"kind": "eager"}
    out, info = _generate(args_for(target, draft if speculative else None, 3, 2, 6,
                                   **{**GPU, **common}), prompts)
    assert info["attention"] == "flashinfer"
    assert out == ref
