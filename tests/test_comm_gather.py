"""all_gather (the vocab-parallel logits gather): every backend returns exactly the
concatenation of every rank's tensor along the last dim, moving each rank's bytes once.

The reference is ``torch.cat`` of every rank's input (each rank rebuilds all inputs from a
seed), compared bit for bit; the old way (an allreduce of a zero-padded buffer) is kept here
as a second reference and must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import comm_backends
from comm_backends.base import AllReduce
from comm_backends.shm import ShmAllReduce, ShmConfig
from tests.test_comm_shm import run_world

# (rows..., width): logits-like shapes, a 1-D one, and one that needs several rounds in SMALL.
SHAPES = ((1, 1024), (32, 1024), (3, 5, 17), (77,), (40, 1000))
SMALL = ShmConfig(buffer_bytes=32 << 10)  # 16 KiB halves: (40, 1000) fp32 takes 10 rounds


def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(world)]


def _padded_reference(backend: AllReduce, x: torch.Tensor) -> torch.Tensor:
    width = x.shape[-1]
    full = x.new_zeros(*x.shape[:-1], width * backend.world_size)
    full[..., backend.rank * width : (backend.rank + 1) * width] = x
    return backend.all_reduce(full)


def _scenario_gather(rank: int, world: int) -> dict[str, Any]:
    cpu = torch.device("cpu")
    backends = {"gloo": comm_backends.create("gloo", None, cpu),
                "shm": comm_backends.create("shm", None, cpu),
                "shm, several rounds": ShmAllReduce(None, cpu, SMALL),
                "shm, torch ops": ShmAllReduce(None, cpu, ShmConfig(native=False))}
    checked = 0
    for name, backend in backends.items():
        for i, shape in enumerate(SHAPES):
            # Twice per dtype: gathers alternate between the segment's two halves, and a plan
            # cached for one dtype at a half must not serve the other dtype of the same shape
            # there (it did: its rows were twice as long, written past the end of ``out``).
            for dtype in (torch.float32, torch.float32, torch.bfloat16, torch.bfloat16):
                inputs = _inputs(world, shape, dtype, 100 * i + 7)
                out = backend.all_gather(inputs[rank].clone())
                expected = torch.cat(inputs, dim=-1)
                assert out.dtype == dtype and torch.equal(out, expected), (name, shape, dtype)
                if dtype == torch.float32:
                    assert torch.equal(_padded_reference(backend, inputs[rank]), expected), name
                checked += 1
        # Interleaved with allreduces of the same shapes: both share the segment's rounds.
        x = torch.full((32, 1024), float(rank + 1))
        assert torch.equal(backend.all_reduce(x), torch.full((32, 1024), world * (world + 1) / 2))
        assert backend.stats.gathers == len(SHAPES) * 4
        backend.close()
    return {"checked": checked}


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_concatenates_exactly(world: int, tmp_path: Path) -> None:
    results = run_world(world, _scenario_gather, tmp_path)
    assert all(r["checked"] == 4 * len(SHAPES) * 4 for r in results.values())


def test_world_of_one_returns_the_input() -> None:
    backend = comm_backends.create("gloo", None, torch.device("cpu"))
    x = torch.arange(6.0).view(2, 3)
    assert backend.all_gather(x) is x
