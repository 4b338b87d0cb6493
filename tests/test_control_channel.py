"""The shared-memory control channel: every rank reads every message in order, and rank 0
runs up to ``slots - 1`` messages ahead of the slowest reader (no further)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tpserve.control import ChannelConfig, ControlChannel

SLOTS = 3


def _messages(count: int) -> list[dict]:
    # Sizes that differ from slot to slot, so a payload read from the wrong slot shows.
    return [{"n": i, "data": np.arange(1 + 50 * i, dtype=np.int64)} for i in range(count)]


def _rank(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world)
    try:
        channel = ControlChannel(None, ChannelConfig(capacity=SLOTS << 16, slots=SLOTS,
                                                     timeout_s=1.0))
        sent = _messages(SLOTS + 1)
        if rank == 0:
            for msg in sent[:SLOTS]:  # nobody has read anything yet: these must not wait
                channel.send(msg)
            try:  # the next would overwrite a slot nobody has read
                channel.send(sent[SLOTS])
                blocked = False
            except TimeoutError:
                blocked = True
            dist.barrier()
            dist.barrier()  # the readers drained the ring
            channel.send(sent[SLOTS])
            with open(out, "w") as f:
                f.write(str(blocked))
        else:
            dist.barrier()
            got = [channel.recv() for _ in range(SLOTS)]
            dist.barrier()
            got.append(channel.recv())
            for a, b in zip(got, sent, strict=True):
                assert a["n"] == b["n"] and np.array_equal(a["data"], b["data"])
        channel.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_runs_ahead_of_readers_and_no_further(world: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "blocked")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), out), nprocs=world, join=True)
        with open(out) as f:
            assert f.read() == "True"


def test_message_larger_than_a_slot_is_refused() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "s"), 1),
                                rank=0, world_size=1)
        try:
            channel = ControlChannel(None, ChannelConfig(capacity=4 << 10, slots=4))
            with pytest.raises(ValueError, match="exceeds a slot"):
                channel.send(b"x" * 2000)
            channel.send(b"y" * 500)  # within a slot
            channel.close()
        finally:
            dist.destroy_process_group()
