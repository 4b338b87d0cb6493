"""torch.compile (inductor) EAGLE-3 draft steps and tree verify match eager greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_compiled import TREE, generate
from tests.test_compiled_inductor import ONE_BUCKET, tiny_pair


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_pair(tmp_path_factory.mktemp("inductor_spec"))


@pytest.mark.slow
def test_inductor_draft_and_verify_match_eager(ckpts: tuple[Path, Path]) -> None:
    torch.set_num_threads(1)
    target, draft = ckpts
    ref, _ = generate(target, None, TREE, 4)
    out, ex = generate(target, draft, TREE, 4, ONE_BUCKET)
    assert out == ref
    assert set(ex.info["compiled"]) == {"draft/B4", "verify/B4"}
