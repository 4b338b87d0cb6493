"""Fixtures shared by several test modules (pytest finds them here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module's tests: its tiny models gain nothing from a second
    thread but synchronisation (10x slower on a busy machine). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tp8_fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The FP8 DeepSeek-V3 that TP 8 shards on block boundaries (``make_tp8_fp8_checkpoint``),
    built once for the modules that shard it."""
    from tests.moe_checkpoints import make_tp8_fp8_checkpoint

    return make_tp8_fp8_checkpoint(tmp_path_factory.mktemp("tp8_fp8"))
