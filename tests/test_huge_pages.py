"""CPU weights live in memory advised as transparent huge pages (layers/huge_pages.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests.checkpoints import make_checkpoint
from tpserve.layers.huge_pages import HUGE_PAGE, huge_arena, rehome_parameters
from tpserve.layers.tp import TPContext
from tpserve.models.registry import build_model


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_arena_is_aligned_zeroed_and_advised() -> None:
    arena = huge_arena(3 << 20)
    assert arena.numel() == 3 << 20 and arena.data_ptr() % HUGE_PAGE == 0
    assert not arena.any()
    assert "hg" in _vm_flags(arena.data_ptr())  # MADV_HUGEPAGE
    assert "sd" not in _vm_flags(arena.data_ptr())  # private, not shmem


def test_rehome_keeps_values_and_identity() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 128))
    module.half()
    params = list(module.parameters())
    before = [p.detach().clone() for p in params]
    x = torch.randn(3, 256).half()
    expected = module(x)
    moved = rehome_parameters(module)
    assert moved == 512 * 256 * 2 + 128 * 512 * 2  # the two weights; biases and norm are small
    assert list(module.parameters()) == params  # the same Parameter objects
    for p, old in zip(module.parameters(), before, strict=True):
        assert torch.equal(p, old)
    big = [module[0].weight, module[2].weight]
    assert all("hg" in _vm_flags(p.data_ptr()) for p in big)
    assert big[1].data_ptr() - big[0].data_ptr() == 512 * 256 * 2  # packed, in order
    assert "hg" not in _vm_flags(module[1].weight.data_ptr())
    assert torch.equal(module(x), expected)


def test_built_cpu_model_reads_its_weights_from_huge_pages(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m", hidden=128, intermediate=256, vocab=512,
                           dtype=torch.bfloat16)
    model = build_model(ckpt, TPContext.single(), torch.bfloat16, torch.device("cpu"), 64)
    layer = model.layers[0]
    for w in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight,
              model.lm_head.weight):
        assert "hg" in _vm_flags(w.data_ptr())
    # The checkpoint's values, not the arena's zeros.
    assert layer.mlp.gate_up_proj.weight.abs().sum() > 0 and model.lm_head.weight.abs().sum() > 0


def test_cpu_kv_cache_is_zeroed_and_advised() -> None:
    from tpserve.engine.kv_cache import KVCache, KVCacheConfig

    cache = KVCache(KVCacheConfig.gqa(40, 16, 3, 2, 32, torch.bfloat16), torch.device("cpu"))
    for pool in cache.pools:
        assert pool.shape == (3, 640, 2, 32) and pool.dtype == torch.bfloat16
        assert pool.is_contiguous() and not pool.any()
        assert "hg" in _vm_flags(pool.data_ptr())
    # Slot moves work on the views as on any tensor.
    cache.pools[0][:, 5] = 1.0
    cache.move_slots([5], [9])
    assert cache.pools[0][:, 9].eq(1.0).all() and cache.layers[2][0][9].eq(1.0).all()
