"""Keep the objects made at start-up out of the garbage collector's full passes.

A served process holds ~220k container objects from start-up (torch, the model's modules,
FastAPI's routes, pydantic's schemas) that live until exit. CPython's full (generation 2)
collection walks every one of them: 120-150 ms on the 2-vCPU dev VM, during which the engine
thread holds the GIL and every stream stops (one such pass came every ~500 requests of the
demo server at 8 clients). Moving them into the permanent generation once start-up is over
leaves the collector only what serving allocates; reference counting still frees them if
they ever become unreachable, only cycles among them would be kept.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("tpserve")


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze the rest; returns the objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d start-up objects frozen out of the garbage collector's passes", frozen)
    return frozen
