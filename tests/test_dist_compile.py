"""torch.compile over a forward that reduces through ``CommSwitch`` at TP > 1: the collective
is a graph break and dynamo does not trace into the backend, whose call counters and clock
reads change every call (guarded on, they recompiled the forward at every call until
dynamo's limit: the served demo pair fell to ~77 tok/s)."""

from __future__ import annotations

from typing import Any

import torch

from tpserve.dist import CommSwitch


class CountingBackend:
    """Stands in for a backend of world size 2: doubles (the sum of two equal ranks) and
    counts its calls, as the real ones' statistics do."""

    world_size = 2

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return tensor * 2

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.cat([tensor, tensor], dim=-1)


def test_collectives_are_opaque_to_compile() -> None:
    backend = CountingBackend()
    comm = CommSwitch({"fake": backend}, "fake")  # type: ignore[dict-item]
    graphs: list[Any] = []

    def count(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = comm.all_reduce(torch.relu(x) + 1)
        return comm.all_gather(y * 3)

    compiled = torch.compile(forward, backend=count, dynamic=False)
    x = torch.randn(2, 4)
    for _ in range(12):
        out = compiled(x)
    assert torch.equal(out, forward(x)) and backend.calls == 26
    assert len(graphs) <= 3, f"{len(graphs)} graphs compiled for 12 calls of one shape"
    torch._dynamo.reset()


def test_one_rank_keeps_a_full_graph() -> None:
    """At TP = 1 the collectives return at once and the forward stays one graph."""
    one = CountingBackend()
    one.world_size = 1
    comm = CommSwitch({"fake": one}, "fake")  # type: ignore[dict-item]
    compiled = torch.compile(lambda x: comm.all_gather(comm.all_reduce(x * 2)),
                             backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(3)
    assert torch.equal(compiled(x), x * 2) and one.calls == 0
    torch._dynamo.reset()
