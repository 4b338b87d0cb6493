"""Fixed-shape execution on CPU: bucket-padded and torch.compile'd phases give the same
greedy tokens as eager, for target decode, EAGLE-3 draft steps and tree verify."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tests.spec_helpers import args_for
from tpserve.engine.buckets import Buckets
from tpserve.engine.compiled import CompileConfig, CompiledExecutor
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine

TREE = (3, 2, 6)  # (steps, topk, draft tokens)
CHAIN = (3, 1, 4)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("compiled")
    target = make_checkpoint(root / "target", "llama", layers=4, hidden=64, vocab=32)
    return target, make_draft(root / "mimic", target, mimic=True)


def _prompts(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[1] + [(7 * i + 3 * j) % 31 + 1 for j in range(2 + 3 * i)] for i in range(n)]
    params = [SamplingParams(max_new_tokens=6 + 5 * (i % 3), temperature=0.0, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def generate(target: Path, draft: Path | None, setting: tuple[int, int, int], n: int,
             executor: dict[str, Any] | None = None) -> tuple[list[list[int]], Any]:
    """Greedy outputs of ``n`` requests; ``executor``: CompileConfig kwargs (None = eager)."""
    engine = OfflineEngine(args_for(target, draft, *setting))
    runner = engine.built.runner
    if executor is not None:
        phases = [runner.decode_forward]
        if engine.spec is not None:
            phases += [engine.spec.drafter.draft_forward, engine.spec.drafter.verify_forward]
        runner.static = CompiledExecutor(phases, CompileConfig(**executor))
    prompts, params = _prompts(n)
    outs = engine.generate(prompts, params)
    engine.close()
    return [o.output_ids for o in outs], runner.static


# Dense small buckets: batches of 5 pad to 6 or 8, key spans pad to 16/32/64.
PADDING = dict(buckets=Buckets((1, 3, 6, 8), (32, 64, 320)), backend="eager",
               dynamic_keys=False)


def test_padded_buckets_match_eager(ckpts: tuple[Path, Path]) -> None:
    """Inert-row/key padding (dynamo-traced, fullgraph, no inductor) changes no token."""
    torch.set_num_threads(1)
    target, draft = ckpts
    ref, _ = generate(target, None, CHAIN, 5)
    out, ex = generate(target, None, CHAIN, 5, PADDING)
    assert out == ref
    assert any(k.startswith("decode/B6") or k.startswith("decode/B8") for k in ex.info["compiled"])
    out, ex = generate(target, draft, TREE, 5, PADDING)
    assert out == ref
    seen = ex.info["compiled"]
    assert any(k.startswith("draft/B6") or k.startswith("draft/B8") for k in seen)
    assert any(k.startswith("verify/B6") or k.startswith("verify/B8") for k in seen)


def test_eager_fallback_above_largest_bucket(ckpts: tuple[Path, Path]) -> None:
    target, _ = ckpts
    ref, _ = generate(target, None, CHAIN, 5)
    small = dict(buckets=Buckets((2,), (64,)), backend="eager", dynamic_keys=False)
    out, ex = generate(target, None, CHAIN, 5, small)
    assert out == ref
    assert set(ex.info["compiled"]) <= {"decode/B2/T64"}
