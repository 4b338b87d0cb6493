"""CPU weights live in memory advised as transparent huge pages (layers/huge_pages.py)."""

from __future__ import annotations

import ctypes
import errno
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.checkpoints import make_checkpoint
from tpserve.layers import huge_pages
from tpserve.layers.huge_pages import (
    HUGE_PAGE,
    NotEnoughMemory,
    huge_arena,
    prefault,
    rehome_parameters,
)
from tpserve.layers.tp import TPContext
from tpserve.models.registry import build_model


def _smaps(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields: dict[str, list[str]] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                if inside:
                    return fields
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                fields[head.rstrip(":")] = line.split()[1:]
    if inside:
        return fields
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps(address)["VmFlags"]


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s whole small pages that are resident (mincore(2))."""
    page = 4096
    start = -(-t.data_ptr() // page) * page
    pages = (t.data_ptr() + t.nbytes - start) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, pages * page, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * page


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


MB = 1 << 20


def test_prefault_backs_every_page_and_keeps_zeros() -> None:
    lazy = huge_arena(8 * MB)
    assert _resident_bytes(lazy) == 0  # nothing touched yet
    backed = huge_pages.huge_zeros((8 * MB // 2,), torch.bfloat16, populate=True)
    assert _resident_bytes(backed) == 8 * MB
    assert not backed.any()


def test_prefault_falls_back_to_touching_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    # An older kernel answers MADV_POPULATE_WRITE with EINVAL: one write per page instead.
    monkeypatch.setattr(huge_pages, "_madvise_populate", lambda t: errno.EINVAL)
    arena = huge_arena(6 * MB)
    assert _resident_bytes(arena) == 0
    prefault(arena[MB + 100:])
    assert _resident_bytes(arena[MB:]) == 5 * MB and not arena.any()


def test_prefault_refusal_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "_madvise_populate", lambda t: errno.ENOMEM)
    with pytest.raises(NotEnoughMemory, match="could not back 2 MB"):
        prefault(huge_arena(2 * MB))


def test_prefault_refuses_more_than_the_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    free = huge_pages.available_bytes()
    assert free is not None and free > 0  # /proc/meminfo is read
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: 3 * MB)
    arena = huge_arena(4 * MB)
    with pytest.raises(NotEnoughMemory, match="could not back 4 MB: 3 MB available"):
        prefault(arena)
    assert _resident_bytes(arena) == 0  # refused before touching anything
    prefault(arena[: 3 * MB])
    assert _resident_bytes(arena[: 3 * MB]) == 3 * MB


def test_available_bytes_takes_a_cgroup_limit(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("5242880\n")
    unlimited = tmp_path / "limit_in_bytes"
    unlimited.write_text("9223372036854771712\n")
    monkeypatch.setattr(huge_pages, "CGROUP_LIMITS", (str(limit), str(unlimited)))
    assert huge_pages.available_bytes() == 5 * MB
    limit.write_text("max\n")
    assert huge_pages.available_bytes() not in (None, 5 * MB)


def test_a_refused_mapping_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    with pytest.raises(NotEnoughMemory, match="could not map 64 MB"):
        huge_arena(64 * MB)


def test_kv_cache_prefault_follows_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from tpserve.args import parse_args
    from tpserve.engine.kv_cache import KVCache, KVCacheConfig, backed_kv
    from tpserve.errors import ConfigError

    cfg = KVCacheConfig.gqa(257, 16, 2, 4, 64, torch.bfloat16)  # 2 x 2 MB + a page per pool
    backed = KVCache(cfg, torch.device("cpu"), prefault=True)
    lazy = KVCache(cfg, torch.device("cpu"))
    assert backed.prefault and not lazy.prefault
    for pool in backed.pools:
        assert _resident_bytes(pool) >= pool.nbytes - 8192 and not pool.any()
    for pool in lazy.pools:
        assert _resident_bytes(pool) == 0
    assert not parse_args([]).disable_kv_prefault
    assert parse_args(["--disable-kv-prefault"]).disable_kv_prefault
    # A cache the OS will not back stops start-up with a flag to turn, not a crash later.
    monkeypatch.setattr(huge_pages, "_madvise_populate", lambda t: errno.ENOMEM)
    with pytest.raises(ConfigError, match="--kv-cache-gb") as info:
        backed_kv(cfg, torch.device("cpu"), prefault=True)
    assert isinstance(info.value.__cause__, NotEnoughMemory)
    assert not backed_kv(cfg, torch.device("cpu"), prefault=False).prefault


def test_kv_cache_refuses_before_backing_any_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    from tpserve.engine.kv_cache import KVCache, KVCacheConfig

    cfg = KVCacheConfig.gqa(257, 16, 2, 4, 64, torch.bfloat16)  # two pools of ~4 MB
    one_pool = 257 * 16 * 2 * 4 * 64 * 2
    backed: list[int] = []
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: one_pool + MB)
    monkeypatch.setattr(huge_pages, "_madvise_populate", lambda t: backed.append(t.nbytes) or 0)
    with pytest.raises(NotEnoughMemory, match="could not back 8 MB"):
        KVCache(cfg, torch.device("cpu"), prefault=True)
    assert backed == []  # the whole cache is weighed first
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: 2 * one_pool)
    KVCache(cfg, torch.device("cpu"), prefault=True)
    assert backed == [one_pool, one_pool]
