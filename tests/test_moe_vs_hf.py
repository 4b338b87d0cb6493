"""DeepSeek-V3, Kimi-K2, Qwen3-MoE and Mixtral equal transformers (fp32), TP 1/2/4, +- EP.

Each family's tiny random checkpoint has the features that matter: DeepSeek-V3 with q_lora,
yarn (mscale != mscale_all_dim), a dense first layer, grouped noaux_tc routing with a non-zero
correction bias and a shared expert, plus a multi-token-prediction layer in its own shard of
an indexed checkpoint; Kimi-K2 with one expert group and a plain q_proj; Qwen3-MoE with a
dense ``mlp_only`` layer; Mixtral; and an FP8 block-quantised DeepSeek-V3 copy, against
transformers on the dequantised weights (TP 1 and 2: its blocks do not divide at TP 4).
Logits must agree within 1e-4 relative and greedy outputs token for token, with experts
split tensor-parallel and with ``--ep-size`` = TP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import build, build_engine, make_request, run_all, spawn
from tests.moe_checkpoints import (
    FAMILIES,
    add_mtp_layer,
    hf_dir,
    make_fp8_checkpoints,
    make_moe_checkpoint,
)
from tests.test_model_vs_hf import assert_close, prefill_logits
from tpserve.engine.sampling_params import SamplingParams
from tpserve.layers.experts import ExpertStack

PROMPTS = [[5, 7, 9, 11, 13, 3, 4], [20, 21, 22], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    paths = {f: make_moe_checkpoint(root / f, f, shards=2 if f == "deepseek" else 1)
             for f in FAMILIES}
    add_mtp_layer(paths["deepseek"])
    paths["deepseek_fp8"] = make_fp8_checkpoints(root)["fp8"]
    return paths


def hf_reference(path: Path) -> tuple[list[torch.Tensor], list[list[int]]]:
    """transformers' prefill logits and greedy continuations of every prompt."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(path), dtype=torch.float32)
    logits, outs = [], []
    with torch.no_grad():
        for ids in PROMPTS:
            logits.append(model(torch.tensor([ids])).logits[0])
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
            outs.append(gen[0, len(ids):].tolist())
    return logits, outs


@pytest.fixture(scope="module")
def reference(checkpoints: dict[str, Path]) -> dict[str, tuple[list[torch.Tensor], list]]:
    return {f: hf_reference(p) for f, p in checkpoints.items()}


def _rank_main(rank: int, world: int, paths: dict[str, Path]) -> dict:
    """Every family at TP = world, experts split (ep 1) and placed (ep = world)."""
    out = {}
    for ep in (1, world):
        for family, path in paths.items():
            built = build(path, allreduce="shm", ep_size=ep)
            stack = next(m for m in built.runner.model.modules() if isinstance(m, ExpertStack))
            placed = (stack.first, stack.local_experts, stack.num_experts)
            logits = prefill_logits(built.runner, PROMPTS[0])  # all ranks: paired allreduces
            if built.engine is not None:
                reqs = [make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
                out[(family, ep)] = (logits, run_all(built.engine, reqs), placed)
                built.shutdown_followers()
            else:
                built.follow()
                out[(family, ep)] = (logits, None, placed)
            if built.channel is not None:
                built.channel.close()
    return out


def _check(results: list[dict], reference: dict, world: int) -> None:
    for (family, ep), (logits, outs, _) in results[0].items():
        ref_logits, ref_outs = reference[family]
        what = f"{family} TP={world} ep={ep}"
        assert_close(logits, ref_logits[0], what)
        assert outs == ref_outs, what
        for rank in range(world):
            assert torch.equal(results[rank][(family, ep)][0], logits), f"{what}: ranks disagree"
            first, local, total = results[rank][(family, ep)][2]
            # ep 1: every expert on every rank; ep = TP: expert e on rank e // (E / TP)
            expected = (0, total) if ep == 1 else (rank * total // world, total // world)
            assert (first, local) == expected, what


def test_tp1_matches_hf(checkpoints: dict[str, Path], reference: dict) -> None:
    for family, path in checkpoints.items():
        engine = build_engine(path)
        for ids, ref in zip(PROMPTS, reference[family][0]):
            assert_close(prefill_logits(engine.runner, ids), ref, family)
        outs = run_all(engine, [make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        assert outs == reference[family][1], family


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_and_expert_parallel_match_hf(checkpoints: dict[str, Path], reference: dict,
                                             world: int) -> None:
    paths = {f: p for f, p in checkpoints.items() if world == 2 or f != "deepseek_fp8"}
    _check(spawn(world, _rank_main, paths), reference, world)
