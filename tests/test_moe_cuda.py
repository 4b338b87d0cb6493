"""DeepSeek-V3 (MLA + MoE) on CUDA: eager and CUDA-graph decoding equal the CPU (GPU only).

fp32 on the GPU must give the CPU's greedy tokens, eagerly (sorted expert path) and under
CUDA graphs (the static all-experts path runs during capture); an FP8 copy in bf16 must run
under graphs with the block-scaled GEMM (or its dequantising fallback) and agree with its own
eager run. Skipped without CUDA; never validated on the machine that wrote it (no GPU was
lent), so a failure here is news, not a known state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.moe_checkpoints import make_fp8_copy, make_moe_checkpoint
from tests.spec_helpers import args_for
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU = dict(device="cuda", allreduce="nccl", max_total_tokens=8192, cuda_graph_bs=(1, 2, 4))


def run(target: Path, **kw: Any) -> list[list[int]]:
    engine = OfflineEngine(args_for(target, **kw))
    prompts = [[1] + [(5 * i + 3 * j) % 90 + 3 for j in range(2 + 3 * i)] for i in range(3)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    engine.close()
    return [o.output_ids for o in outs]


def test_deepseek_cuda_eager_and_graphs_match_cpu(tmp_path: Path) -> None:
    target = make_moe_checkpoint(tmp_path / "ds", "deepseek")
    ref = run(target)
    assert run(target, **GPU, disable_cuda_graph=True) == ref
    assert run(target, **GPU) == ref


def test_fp8_deepseek_cuda_graphs_match_eager(tmp_path: Path) -> None:
    shape = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 num_attention_heads=4, qk_nope_head_dim=64, v_head_dim=64, kv_lora_rank=128,
                 q_lora_rank=128)
    src = make_moe_checkpoint(tmp_path / "src", "deepseek", **shape)
    make_fp8_copy(src, tmp_path / "fp8", tmp_path / "ref", (128, 128))
    eager = run(tmp_path / "fp8", **GPU, dtype="bfloat16", disable_cuda_graph=True)
    assert run(tmp_path / "fp8", **GPU, dtype="bfloat16") == eager
