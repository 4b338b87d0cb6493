"""The native decoder stack at TP = 2 on ``shm``: the allreduces between layer halves run
inside one op call (``StackExchange``), bit-equal to the per-layer path, counted like it,
and a peer that stops makes the call fail instead of hanging."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from comm_backends.shm import ShmAllReduce
from comm_backends.shm_native import load as load_shm_native
from tests.spec_helpers import run_tp
from tests.test_decoder_stack import LAYERS, _model, _native_or_skip, _run, _step
from tpserve.dist import CommSwitch
from tpserve.layers.tp import TPContext

CPU = torch.device("cpu")


def _skip_without_native() -> None:
    _native_or_skip()
    if load_shm_native() is None:
        pytest.skip("the shm backend's compiled exchange did not build here")


class CountingSwitch(CommSwitch):
    """Counts the calls the native stack reports, and can refuse it (the per-layer path)."""

    def __init__(self, backend: ShmAllReduce, native: bool) -> None:
        super().__init__({"shm": backend}, "shm")
        self.native, self.stacked = native, 0

    def stack_exchange(self, dtype: torch.dtype, shape: torch.Size) -> Any:
        return super().stack_exchange(dtype, shape) if self.native else None

    def stack_exchanged(self, ex: Any, calls: int, nbytes: int) -> None:
        self.stacked += calls
        super().stack_exchanged(ex, calls, nbytes)


def _forwards(bias: bool) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    backend = ShmAllReduce(None, CPU)
    out: dict[str, Any] = {}
    try:
        for label, native in (("native", True), ("per_layer", False), ("native_again", True)):
            comm = CountingSwitch(backend, native)
            model = _model("LlamaForCausalLM", torch.bfloat16, TPContext(rank, 2, comm), bias=bias)
            # Rank-dependent inputs: the reduction must really sum two different partials.
            fb, kv = _step(None, [1, 3], [12, 2], torch.bfloat16, None, 2)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 + 0.25 * rank)
            before = (backend.stats.calls, backend.stats.bytes)
            seconds = backend.stats.seconds
            result = _run(model, fb, kv, (1,), True)
            counted = (backend.stats.calls - before[0], backend.stats.bytes - before[1])
            out[label] = (result, counted, comm.stacked)
            out[f"{label}_seconds"] = backend.stats.seconds - seconds
        # One plain allreduce after the native calls: the sequence numbers still agree.
        out["after"] = backend.all_reduce(torch.full((4,), float(rank + 1))).tolist()
    finally:
        backend.close()
    return out


@pytest.mark.parametrize("bias", [False, True])
def test_native_stack_reduces_like_the_per_layer_path(bias: bool) -> None:
    _skip_without_native()
    got = run_tp(2, _forwards, bias)
    (native, calls, stacked), (per_layer, calls_pl, stacked_pl) = got["native"], got["per_layer"]
    hidden, aux, caches = native
    assert torch.equal(hidden, per_layer[0]) and torch.equal(aux[0], per_layer[1][0])
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(caches, per_layer[2], strict=True))
    assert torch.equal(got["native_again"][0][0], hidden)
    # Layers 0 and 1..2 (the aux split): two reductions a layer, counted either way.
    assert stacked == 2 * LAYERS and stacked_pl == 0
    assert calls == calls_pl  # (calls, bytes): counted alike
    # Timed alike too: the native calls add up their own time (they were counted at 0 s).
    assert got["native_seconds"] > 0 and got["per_layer_seconds"] > 0, got
    assert got["after"] == [3.0] * 4


def _peer_stops(_: Any) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    backend = ShmAllReduce(None, CPU)
    try:
        comm = CountingSwitch(backend, True)
        model = _model("LlamaForCausalLM", torch.bfloat16, TPContext(rank, 2, comm))
        fb, kv = _step(None, [1], [5], torch.bfloat16, None, 2)
        torch.distributed.barrier()
        if rank == 1:
            backend.stack_failed("stopped by the test")  # marks this rank aborted
            torch.distributed.barrier()
            return {}
        rotary = model.rotary.at(fb.positions, torch.bfloat16)
        meta = model.attention.prepare(fb.attn).meta
        x = torch.ones(1, 128, dtype=torch.bfloat16)  # the stack's first collective is its own
        try:
            with torch.inference_mode():
                model.stack.run(x, rotary.cos, rotary.sin, meta, 0, 0.1, kv, [])
            error = ""
        except RuntimeError as exc:
            error = str(exc)
        torch.distributed.barrier()
        return {"error": error, "broken": backend._board.broken}
    finally:
        backend.close()


def test_a_stopped_peer_fails_the_native_stack() -> None:
    _skip_without_native()
    got = run_tp(2, _peer_stops, None)
    assert "a peer stopped" in got["error"]
    assert got["broken"]
