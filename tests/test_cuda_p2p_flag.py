"""The host side of cuda_p2p's bounded spin, on CPU: the give-up word the kernel writes is
decoded into one clear error, and the kernel source encodes it the way the host decodes it.
(The kernel actually timing out is tests/test_comm_cuda.py's, on a GPU.)
"""

from __future__ import annotations

import re

import numpy
import pytest
import torch

from comm_backends.cuda_p2p_flag import (
    FAILED_BIT,
    CollectiveTimeout,
    GiveUp,
    decode,
    encode,
    raise_if_failed,
)
from comm_backends.cuda_p2p_kernels import ERROR_WORD, SIGNAL_BYTES, SOURCE


def test_a_clear_word_raises_nothing() -> None:
    flag = torch.zeros(4, dtype=torch.int32).numpy()  # as the backend's pinned word starts
    raise_if_failed(flag, rank=0, timeout_s=30.0)
    assert decode(0) is None


def test_a_give_up_becomes_one_clear_error() -> None:
    flag = torch.zeros(4, dtype=torch.int32).numpy()
    flag[0] = numpy.uint32(encode(peer=3, phase=2, block=17)).view(numpy.int32)  # bit 31: negative
    with pytest.raises(CollectiveTimeout) as info:
        raise_if_failed(flag, rank=1, timeout_s=30.0)
    message = str(info.value)
    assert "\n" not in message
    for part in ("rank 1 waited over 30s for rank 3", "end of a call", "block 17", "IOMMU/ACS"):
        assert part in message, message
    assert isinstance(info.value, RuntimeError)  # the engine treats it like any failed step


@pytest.mark.parametrize("peer,phase,block", [(0, 0, 0), (7, 1, 31), (5, 2, 3)])
def test_encoding_round_trips(peer: int, phase: int, block: int) -> None:
    word = encode(peer, phase, block)
    assert word & FAILED_BIT and decode(word) == GiveUp(peer, phase, block)


def test_the_kernel_writes_what_the_host_decodes() -> None:
    """The CUDA expression, evaluated here with the same operator precedence, matches encode."""
    expr = re.search(r"const u32 code = (.*?);", SOURCE, re.S).group(1)
    assert f"#define FAILED_BIT {FAILED_BIT:#x}u" in SOURCE
    py = (" ".join(expr.split()).replace("FAILED_BIT", str(FAILED_BIT)).replace("(u32)", "").replace("0xffu", "0xff")
          .replace("blockIdx.x", "block"))
    for peer, phase, block in ((3, 2, 17), (0, 1, 0), (7, 0, 31)):
        assert eval(py, {}, {"peer": peer, "phase": phase, "block": block}) == encode(peer, phase, block)
    # The word sits in the signal area, after the arrival words and call counters.
    assert (ERROR_WORD + 1) * 4 <= SIGNAL_BYTES
