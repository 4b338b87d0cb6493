"""FlagBoard's move off a CPU it shares with a peer (shm_flags.FlagBoard._unstack).

Run in a subprocess: the move changes the calling thread's CPU and affinity mask, which must
not leak into the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, mmap, os
    import comm_backends.shm_flags as flags
    from comm_backends.shm_flags import FlagBoard, _cpu_reader
    from comm_backends.shm_segment import ProcId

    # The rate limit (2 ms) is shorter than a loaded machine may take between two calls:
    # stretch it so "again" is always inside it.
    flags._UNSTACK_PERIOD_S = 60.0

    getcpu = _cpu_reader()
    allowed = os.sched_getaffinity(0)

    def board(world):
        peers = {r: ProcId.current() for r in range(world)}
        return FlagBoard(mmap.mmap(-1, 4096), 0, peers, 1.0, 0.0)

    b = board(2)
    before = getcpu()
    moved = b._unstack()
    after = getcpu()
    again = b._unstack()  # within the rate limit: refused
    many = board(len(allowed) + 1)._unstack()  # more ranks than CPUs: they must share
    print(json.dumps({"before": before, "moved": moved, "after": after, "again": again,
                      "many": many, "mask_kept": os.sched_getaffinity(0) == allowed}))
""")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs at least two CPUs in this process's affinity mask")
def test_unstack_moves_to_another_cpu_and_keeps_the_mask() -> None:
    import json

    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                         check=True)
    result = json.loads(out.stdout)
    assert result["moved"] is True
    assert result["after"] != result["before"]
    assert result["again"] is False
    assert result["many"] is False
    assert result["mask_kept"] is True
