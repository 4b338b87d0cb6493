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


def test_chain_verify_through_flashinfers_mla_kernel_equals_plain(
        ckpts: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, with the target's MLA on FlashInfer's kernel (the CPU stand-in of
    ``tests/fake_flashinfer``, as ``auto`` picks it on a GPU): a chain's verify (topk 1) runs
    the kernel causally, a tree's keeps the ``mla`` backend, and greedy output is unchanged."""
    import tpserve.models.deepseek_v3 as ds
    from tests import fake_flashinfer
    from tpserve.layers.mla_flashinfer import FlashInferBoundMLA, FlashInferMLA

    torch.set_num_threads(1)
    verifies: dict[str, int] = {"kernel": 0, "mla": 0}

    class Recording(FlashInferMLA):
        def bind(self, meta):  # type: ignore[no-untyped-def]
            bound = super().bind(meta)
            if meta.custom_mask is not None:
                verifies["kernel" if isinstance(bound, FlashInferBoundMLA) else "mla"] += 1
            return bound

    real = ds.choose_mla_backend

    def on_the_kernel(requested: str, latent: int, rank: int, rope: int, heads: int,
                      scale: float, dtype: torch.dtype, device: torch.device) -> object:
        if requested != "auto":
            return real(requested, latent, rank, rope, heads, scale, dtype, device)
        return Recording(latent, rank, heads, scale, dtype, device,
                         flashinfer=fake_flashinfer.module())

    monkeypatch.setattr(ds, "choose_mla_backend", on_the_kernel)
    target, mimic, sub = ckpts
    plain, _ = generate(target, None, (3, 1, 4))
    chain, accept = generate(target, mimic, (3, 1, 4))
    assert chain == plain and accept > 1.1, accept
    assert verifies["kernel"] > 0 and verifies["mla"] == 0, verifies
    verifies.update(kernel=0, mla=0)
    tree, _ = generate(target, sub, (3, 2, 6))
    assert tree == plain
    assert verifies["mla"] > 0 and verifies["kernel"] == 0, verifies
