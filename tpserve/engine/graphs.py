"""CUDA graphs for the decode-time static forwards: one graph per batch-size bucket and forward.

Each graph owns static input buffers ([B, Q] ids/positions/write slots, [B, T] read slots,
[B, 1, Q, T] mask, extras) and replays the forward's kernels without any CPU launch cost. A
batch of n requests is copied into the smallest bucket B >= n; rows n..B are inert (token 0,
dummy slot 0, attend to slot 0 only), so they cannot touch real KV. Batches above the
largest bucket, and prefill, run eagerly.

Key length: the gather-based attention's T is a tensor dimension, so it is fixed per graph
at ``max_keys`` = the context (plus speculative lookahead) rounded to the page size. The
trade-off: a short sequence still gathers and attends over max_keys keys (masked columns
read the dummy slot, which stays cache-resident, but the gathered [B, T, Hk, D] buffers and
the SDPA work scale with max_keys), and activation memory is sized for the full context.
In exchange there is one graph per batch bucket rather than one per (B, T) pair.

All graphs share one memory pool (``torch.cuda.graph_pool_handle``): they are replayed one
at a time, so their intermediates can overlap. Each graph's outputs stay allocated in the
pool; ``run`` returns copies, so replaying another graph can never clobber a result the
caller still holds.

Allreduces inside capture go through the active ``AllReduce``; at TP > 1 it must declare
``capture_safe`` (checked at start-up, see ``static_setup``). Graphs capture the backend
active at capture time: after a live switch to another backend, steps run eagerly. Backend
call statistics are Python-side, so they are not updated by replays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tpserve.dist import CommSwitch
from tpserve.engine.buckets import pad_forward_batch
from tpserve.engine.compiled import inert_batch
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.static_forward import StaticForward

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphConfig:
    batch_sizes: tuple[int, ...]  # ascending buckets
    max_keys: int  # static T of every graph (multiple of the page size)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    batch: ForwardBatch  # static inputs
    extras: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


class CudaGraphExecutor:
    """``StaticExecutor`` over captured CUDA graphs."""

    def __init__(self, cfg: GraphConfig, device: torch.device, comm: CommSwitch | None) -> None:
        self.cfg, self.device, self.comm = cfg, device, comm
        self.pool = torch.cuda.graph_pool_handle()
        self.backend = comm.active_name if comm is not None else None
        self.forwards: dict[str, StaticForward] = {}
        self.graphs: dict[str, dict[int, _Captured]] = {}
        self.info: dict[str, Any] = {"kind": "cuda_graph", "batch_sizes": list(cfg.batch_sizes),
                                     "max_keys": cfg.max_keys, "allreduce": self.backend,
                                     "sets": {}}

    def run(self, name: str, fb: ForwardBatch,
            extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        graphs, spec = self.graphs.get(name), self.forwards.get(name)
        if not graphs or spec is None or fb.num_queries != spec.queries:
            return None
        if self.comm is not None and self.comm.active_name != self.backend:
            return None  # captured kernels belong to the backend active at capture
        batch, keys = fb.read_slots.shape
        bucket = next((b for b in self.cfg.batch_sizes if b >= batch), None)
        if bucket is None or keys > self.cfg.max_keys:
            return None
        cap = graphs[bucket]
        padded = pad_forward_batch(fb, bucket, self.cfg.max_keys)
        for dst, src in zip(_fields(cap.batch), _fields(padded), strict=True):
            dst.copy_(src, non_blocking=True)
        for name, buf in cap.extras.items():
            buf[:batch].copy_(extras[name])
            buf[batch:].zero_()
        cap.graph.replay()
        rows = batch * spec.queries
        return tuple(o[:rows].clone() for o in cap.outputs)

    def refresh(self, forwards: list[StaticForward]) -> None:
        """Recapture just ``forwards`` (e.g. verify/draft after a live speculative change)."""
        for forward in forwards:
            if forward.name in self.graphs:
                self.graphs.pop(forward.name)
                self.capture(forward)

    def on_backend_change(self) -> None:
        """Captured collectives belong to the backend active at capture: recapture them all
        (every rank does this between the same two steps, so the captures pair up)."""
        self.backend = self.comm.active_name if self.comm is not None else None
        self.info["allreduce"] = self.backend
        for forward in list(self.forwards.values()):
            self.graphs.pop(forward.name, None)
            self.capture(forward)

    @torch.inference_mode()
    def capture(self, forward: StaticForward, progress: Callable[[str], None] = log.info) -> None:
        """Capture ``forward`` for every bucket (largest first, so later ones fit its pool)."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        self.forwards[forward.name] = forward
        graphs = self.graphs.setdefault(forward.name, {})
        sizes = sorted(self.cfg.batch_sizes, reverse=True)
        with _timing_off(self.comm):
            for i, bs in enumerate(sizes):
                progress(f"capturing CUDA graph '{forward.name}' batch {bs} ({i + 1}/{len(sizes)})")
                graphs[bs] = self._capture_one(forward, bs)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.info["sets"][forward.name] = {"graphs": len(sizes), "capture_s": round(seconds, 3),
                                         "memory_mb": round(used / 2**20, 1)}
        log.info("captured %d '%s' graphs in %.1fs using %.0f MB", len(sizes), forward.name,
                 seconds, used / 2**20)

    def _capture_one(self, forward: StaticForward, bs: int) -> _Captured:
        fb = inert_batch(bs, forward.queries, self.cfg.max_keys, self.device)
        extras = {k: torch.zeros(bs, forward.queries, *shape, dtype=dtype, device=self.device)
                  for k, (shape, dtype) in forward.extras.items()}
        # Warm up on a side stream: lazy initialisations (cuBLAS handles, NCCL communicators,
        # autotuning) must happen before capture, where they are not allowed.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                forward.fn(fb, extras)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = forward.fn(fb, extras)
        return _Captured(graph, fb, extras, outputs)


def _fields(fb: ForwardBatch) -> tuple[torch.Tensor, ...]:
    return fb.input_ids, fb.positions, fb.write_slots, fb.read_slots, fb.mask


@contextmanager
def _timing_off(comm: CommSwitch | None) -> Iterator[None]:
    """Backend timing synchronises the device, which is illegal during capture."""
    saved = [b.stats.enabled for b in comm.backends.values()] if comm is not None else []
    if comm is not None:
        comm.set_profiling(False)
    try:
        yield
    finally:
        if comm is not None:
            for backend, enabled in zip(comm.backends.values(), saved, strict=True):
                backend.stats.enabled = enabled
