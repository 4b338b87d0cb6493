"""tpserve's logits and greedy outputs equal Hugging Face transformers' (fp32, TP = 1, 2, 4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checkpoints import ARCH_CONFIGS, make_checkpoint
from tests.harness import build, build_engine, make_request, run_all, spawn
from tpserve.engine.messages import ForwardStep
from tpserve.engine.sampling_params import SamplingParams

ARCHS = list(ARCH_CONFIGS)
PROMPTS = [[5, 7, 9, 11, 13, 3, 4], [20, 21, 22], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    # "llama" is written in two shards to exercise the safetensors index path.
    return {a: make_checkpoint(root / a, a, shards=2 if a == "llama" else 1) for a in ARCHS}


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_greedy(path: Path, ids: list[int], n: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def prefill_logits(runner, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    pages = np.arange(1, 1 + -(-len(ids) // 4), dtype=np.int32)[None]
    step = ForwardStep(np.array(ids, dtype=np.int64), np.array([len(ids)], dtype=np.int32),
                       np.array([0], dtype=np.int32), pages, np.arange(len(ids)))
    return runner.forward(step, step.logit_rows).logits


def _rank_logits(rank: int, world: int, paths: dict[str, Path]) -> dict[str, torch.Tensor]:
    # Every rank runs the same forward directly (no engine loop): gloo pairs the allreduces.
    return {a: prefill_logits(build(p).runner, PROMPTS[0]) for a, p in paths.items()}


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert rel < 1e-4, f"{what}: relative error {rel:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf_tp1(checkpoints: dict[str, Path], arch: str) -> None:
    engine = build_engine(checkpoints[arch])
    for ids in PROMPTS:
        assert_close(prefill_logits(engine.runner, ids), hf_logits(checkpoints[arch], ids), arch)


@pytest.mark.parametrize("world", [2, 4])
def test_logits_match_hf_tensor_parallel(checkpoints: dict[str, Path], world: int) -> None:
    # 4 query heads / 2 KV heads: TP=4 replicates each KV head over two ranks.
    results = spawn(world, _rank_logits, checkpoints)
    for arch, path in checkpoints.items():
        ref = hf_logits(path, PROMPTS[0])
        for rank in range(world):
            assert_close(results[rank][arch], ref, f"{arch} TP={world} rank {rank}")
        assert torch.equal(results[0][arch], results[-1][arch]), "ranks disagree"


def _rank_greedy(rank: int, world: int, paths: dict[str, Path]) -> dict[str, list[list[int]]]:
    out = {}
    for arch, path in paths.items():
        built = build(path)
        if built.engine is not None:
            reqs = [make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
            out[arch] = run_all(built.engine, reqs)
            built.shutdown_followers()
        else:
            built.follow()
        if built.channel is not None:
            built.channel.close()
    return out


def test_greedy_generation_matches_hf_tp1(checkpoints: dict[str, Path]) -> None:
    for arch in ("llama", "qwen3"):
        engine = build_engine(checkpoints[arch])
        reqs = [make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        ours = run_all(engine, reqs)  # all three decoded together: continuous batching
        for ids, got in zip(PROMPTS, ours):
            assert got == hf_greedy(checkpoints[arch], ids, 32), arch


def test_greedy_generation_matches_hf_tp2(checkpoints: dict[str, Path]) -> None:
    paths = {a: checkpoints[a] for a in ("llama", "qwen2", "mistral")}
    ours = spawn(2, _rank_greedy, paths)[0]
    for arch, path in paths.items():
        for ids, got in zip(PROMPTS, ours[arch]):
            assert got == hf_greedy(path, ids, 32), arch


# head_dim 32 (hidden 128 over 4 heads): the native CPU attention and, with it, the native
# layer stack (fused_decoder) run every decode step; the checkpoints above (head_dim 16) take
# the Python layers on AVX-512 machines.
WIDE = ("llama", "qwen2")


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wide")
    return {a: make_checkpoint(root / a, a, hidden=128) for a in WIDE}


def _rank_greedy_stacked(rank: int, world: int, paths: dict[str, Path]
                         ) -> dict[str, tuple[list[list[int]], str]]:
    out = {}
    for arch, path in paths.items():
        built = build(path)
        reason = built.runner.model.stack_reason if built.runner.model.stack is None else ""
        if built.engine is not None:
            reqs = [make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
            out[arch] = (run_all(built.engine, reqs), reason)
            built.shutdown_followers()
        else:
            built.follow()
            out[arch] = ([], reason)
        if built.channel is not None:
            built.channel.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_native_layer_stack_greedy_matches_hf(wide_checkpoints: dict[str, Path],
                                              world: int) -> None:
    results = spawn(world, _rank_greedy_stacked, wide_checkpoints) if world > 1 else \
        [_rank_greedy_stacked(0, 1, wide_checkpoints)]
    for arch, path in wide_checkpoints.items():
        for rank in range(world):
            assert results[rank][arch][1] in ("", "attention backend is not 'cpu'"), arch
        if results[0][arch][1]:
            pytest.skip(f"native CPU attention unavailable here: {results[0][arch][1]}")
        for ids, got in zip(PROMPTS, results[0][arch][0], strict=True):
            assert got == hf_greedy(path, ids, 32), (arch, world)
