"""freeze_startup_heap: what start-up made is out of the collector's passes, garbage is not."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap


def test_freeze_leaves_later_objects_to_the_collector() -> None:
    # In a child: freezing is process-wide and would outlive this test in the pytest process.
    code = textwrap.dedent("""
        import gc
        from tpserve.heap import freeze_startup_heap
        import torch  # a large start-up heap
        frozen = freeze_startup_heap()
        assert frozen > 10_000 and gc.get_freeze_count() == frozen, frozen
        assert len(gc.get_objects()) < frozen // 10  # tracked = only what came after
        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after the freeze is still collected
        del a, b
        assert gc.collect() >= 2
        print(frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 10_000
    assert gc.get_freeze_count() == 0  # this process untouched
