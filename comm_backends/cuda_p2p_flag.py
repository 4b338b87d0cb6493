"""The ``cuda_p2p`` kernels' give-up flag: its encoding, and the host side that reads it.

A kernel that waits longer than its spin limit for a peer stops waiting and records why in a
32-bit word: in its own signal area (so later kernels on that rank return at once instead of
waiting again) and in a word of pinned host memory, which the host reads with a plain load
(no device sync), so ``check()`` is cheap enough for every call and every step. Decoding and
raising live here, apart from any GPU, so they are tested on CPU.

Word layout: bit 31 set = gave up; bits 16-23 the block, bits 8-15 the phase (0 start,
1 middle, 2 end of a call), bits 0-7 the peer rank it was waiting for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy

FAILED_BIT = 0x80000000
PHASE_NAMES = ("start", "middle", "end")


class CollectiveTimeout(RuntimeError):
    """A collective kernel gave up waiting for a peer; its results are invalid."""


@dataclass(frozen=True)
class GiveUp:
    peer: int
    phase: int
    block: int


def encode(peer: int, phase: int, block: int) -> int:
    """What the kernel stores (the CUDA source computes the same expression)."""
    return FAILED_BIT | (block & 0xFF) << 16 | (phase & 0xFF) << 8 | (peer & 0xFF)


def decode(word: int) -> GiveUp | None:
    if not word & FAILED_BIT:
        return None
    return GiveUp(peer=word & 0xFF, phase=(word >> 8) & 0xFF, block=(word >> 16) & 0xFF)


def describe(event: GiveUp, rank: int, timeout_s: float) -> str:
    phase = PHASE_NAMES[event.phase] if event.phase < len(PHASE_NAMES) else str(event.phase)
    return (f"cuda_p2p allreduce: rank {rank} waited over {timeout_s:g}s for rank {event.peer} "
            f"({phase} of a call, block {event.block}) and gave up: that rank died or stalled, "
            "or P2P between their GPUs does not deliver writes (IOMMU/ACS); every result since "
            "is invalid")


def raise_if_failed(flag: numpy.ndarray, rank: int, timeout_s: float) -> None:
    """Raise CollectiveTimeout if the kernels of this rank gave up (``flag``: the host word)."""
    event = decode(int(flag[0]))
    if event is not None:
        raise CollectiveTimeout(describe(event, rank, timeout_s))
