"""EAGLE-3 speculative greedy decoding on an MLA + MoE target equals plain greedy decoding.

The target is a 4-layer DeepSeek-V3 (latent cache, routed + shared experts); the drafts are
published-format EAGLE-3 checkpoints whose auxiliary features come from MLA/MoE layers: one
that repeats the target's last token (accepted where the target repeats) and a random one
over a reduced draft vocab.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.eagle_checkpoints import make_draft
from tests.moe_checkpoints import make_moe_checkpoint
from tests.spec_helpers import args_for
from tests.test_spec_greedy import prompts_and_params
from tpserve.offline import OfflineEngine


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("spec_moe")
    target = make_moe_checkpoint(root / "target", "deepseek", vocab=32, num_hidden_layers=4)
    # scale 0: the midlayer adds nothing, so the draft proposes exactly "the target's last
    # token again", accepted wherever the target repeats itself.
    mimic = make_draft(root / "mimic", target, mimic=True, scale=0.0)
    sub = make_draft(root / "sub", target, draft_ids=[0, 3, 5, 8, 13, 21, 30], seed=3)
    return target, mimic, sub


def generate(target: Path, draft: Path | None, setting: tuple[int, int, int]
             ) -> tuple[list[list[int]], float]:
    """Outputs, and the average accepted length per verify (0 without a draft)."""
    engine = OfflineEngine(args_for(target, draft, *setting))
    prompts, params = prompts_and_params()
    outs = engine.generate(prompts, params)
    accept = engine.spec.stats.snapshot().get("avg_accept_length", 0.0) if engine.spec else 0.0
    engine.close()
    return [o.output_ids for o in outs], accept


def test_speculative_greedy_equals_plain_on_mla_moe(ckpts: tuple[Path, Path, Path]) -> None:
    torch.set_num_threads(1)
    target, mimic, sub = ckpts
    plain, _ = generate(target, None, (3, 1, 4))
    chain, accept = generate(target, mimic, (3, 1, 4))
    assert chain == plain
    assert accept > 1.1, accept  # drafts were accepted: verify + KV compaction really ran
    tree, _ = generate(target, sub, (3, 2, 6))
    assert tree == plain
