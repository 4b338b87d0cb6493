"""torch.compile (inductor) target decode gives the same greedy tokens as eager on CPU.

One batch bucket (T symbolic) keeps this to a single compilation; draft and verify compile in
test_compiled_inductor_spec.py (separate files keep each under the CI time budget).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tests.test_compiled import TREE, generate
from tpserve.engine.buckets import Buckets

ONE_BUCKET = dict(buckets=Buckets((4,)))


def tiny_pair(root: Path) -> tuple[Path, Path]:
    """2-layer target (fast to compile) and a mimic draft reading layer inputs 0, 1, 2."""
    target = make_checkpoint(root / "target", "llama", layers=2, hidden=64, vocab=32)
    return target, make_draft(root / "mimic", target, mimic=True, aux_ids=(-1, 0, 1))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_pair(tmp_path_factory.mktemp("inductor"))


@pytest.mark.slow
def test_inductor_decode_matches_eager(ckpts: tuple[Path, Path]) -> None:
    torch.set_num_threads(1)
    target, _ = ckpts
    ref, _ = generate(target, None, TREE, 4)
    out, ex = generate(target, None, TREE, 4, ONE_BUCKET)
    assert out == ref
    assert list(ex.info["compiled"]) == ["decode/B4"]
    assert ex.info["compile_s"] > 0
