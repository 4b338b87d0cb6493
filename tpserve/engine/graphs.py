"""CUDA graphs for the decode-time static forwards: one graph per batch-size bucket and forward.

Each graph owns static inputs (token ids, positions, and the attention metadata: page table,
query offsets, key counts, write slots, speculative mask) and replays the forward's kernels
without any CPU launch cost. A batch of b requests is padded to the smallest bucket B >= b
with inert requests (dummy page 0 only), so they cannot touch real KV. Batches above the
largest bucket, and prefill, run eagerly (counted, see ``static_forward.run_static``).

Key span: a backend whose preparation is device work (``torch``, and MLA, which prepares
through it) is prepared inside the graph and sizes its key gather by the static page table's
width. So such forwards are captured per (batch bucket, key span): spans from 4096 keys up by
4x to the context limit (plus the speculative lookahead, ``key_spans``), and a replay takes
the narrowest span that holds its longest request, gathering at most 4x that request's keys
(or 4096) per row and layer instead of the context limit's worth. A bucket keeps its wider
spans only within a gather budget (``GraphConfig.gather_tokens``, ``buckets.graph_spans``):
a step that is both large and long runs eagerly. ``flashinfer`` instead
plans on the host (``AttentionBackend.graph_capture`` before capture, ``graph_replan`` with the
step's real, bucket-padded layout before each replay, O(pages used)); the decode graph runs
FlashInfer's CUDA-graph decode over fixed buffers, so a replayed decode step attends over the
pages its requests use, and is captured at one span (``graph_reads_in_place``). Draft and
verify graphs (speculative masks) run the ``torch`` gather under either backend
(``flashinfer_backend``), so they take the spans. ``auto`` picks ``flashinfer`` on CUDA where
it can run the model (``static_setup.graph_attention_line`` logs the choice and, for
``torch``, why).

All graphs share one memory pool (``torch.cuda.graph_pool_handle``): they are replayed one
at a time, so their intermediates can overlap. Each graph's outputs stay allocated in the
pool; ``run`` returns copies, so replaying another graph can never clobber a result the
caller still holds.

Allreduces inside capture go through the active ``AllReduce``; at TP > 1 it must declare
``capture_safe`` (checked at start-up, see ``static_setup``). Graphs capture the backend
active at capture time: a live switch recaptures. Backend call statistics are Python-side,
so they are not updated by replays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from tpserve.dist import CommSwitch
from tpserve.engine.buckets import graph_spans, inert_batch, pad_forward_batch
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.static_forward import StaticForward
from tpserve.layers.attention.base import GraphPlanned

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphConfig:
    batch_sizes: tuple[int, ...]  # ascending buckets
    max_keys: int  # keys a request can have (context + lookahead, a page multiple)
    page_size: int
    mask_width: dict[str, int] = field(default_factory=dict)  # speculative mask per forward
    spans: tuple[int, ...] = ()  # ascending key spans, the last max_keys (empty: max_keys only)
    gather_tokens: int | None = None  # most bucket x span a gathering graph holds (graph_spans)

    @property
    def key_spans(self) -> tuple[int, ...]:
        return self.spans or (self.max_keys,)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    batch: ForwardBatch  # static inputs
    extras: dict[str, torch.Tensor]
    outputs: tuple[torch.Tensor, ...]
    backends: tuple[GraphPlanned, ...] = ()  # planned on the host before each replay


class CudaGraphExecutor:
    """``StaticExecutor`` over captured CUDA graphs."""

    def __init__(self, cfg: GraphConfig, device: torch.device, comm: CommSwitch | None) -> None:
        self.cfg, self.device, self.comm = cfg, device, comm
        self.pool = torch.cuda.graph_pool_handle()
        self.backend = comm.active_name if comm is not None else None
        self.forwards: dict[str, StaticForward] = {}
        # forward -> (batch bucket, key span) -> graph
        self.graphs: dict[str, dict[tuple[int, int], _Captured]] = {}
        # forward -> batch bucket -> the key spans captured for it
        self.spans: dict[str, dict[int, tuple[int, ...]]] = {}
        self.info: dict[str, Any] = {"kind": "cuda_graph", "batch_sizes": list(cfg.batch_sizes),
                                     "max_keys": cfg.max_keys, "key_spans": list(cfg.key_spans),
                                     "allreduce": self.backend, "sets": {}}

    def run(self, name: str, fb: ForwardBatch,
            extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        graphs, spec = self.graphs.get(name), self.forwards.get(name)
        if not graphs or spec is None or fb.queries != spec.queries:
            return None
        if self.comm is not None and self.comm.active_name != self.backend:
            return None  # captured kernels belong to the backend active at capture
        batch = fb.batch_size
        bucket = next((b for b in self.cfg.batch_sizes if b >= batch), None)
        # No bucket holds the batch, or none of its spans the longest request: eager.
        span = next((k for k in self.spans[name].get(bucket, ()) if k >= fb.attn.max_kv_len),
                    None)
        if bucket is None or span is None:
            return None
        cap = graphs[(bucket, span)]
        if not _fits_mask(cap.batch, fb):
            # A live tree-shape change (admin) widened the speculative mask past the width
            # captured at launch: eager, like any batch no graph fits (the same on all ranks).
            return None
        padded = pad_forward_batch(fb, bucket)
        _copy_inputs(cap.batch, padded)
        for backend in cap.backends:
            backend.graph_replan(cap.batch.attn, padded.attn)
        for name_, buf in cap.extras.items():
            buf[:batch].copy_(extras[name_])
            buf[batch:].zero_()
        cap.graph.replay()
        rows = batch * spec.queries
        return tuple(o[:rows].clone() for o in cap.outputs)

    def refresh(self, forwards: list[StaticForward]) -> None:
        """Recapture just ``forwards`` (e.g. verify/draft after a live speculative change)."""
        for forward in forwards:
            if forward.name in self.forwards:
                self._drop(forward.name)
                self.forwards[forward.name] = forward  # kept even while not captured
                if self.capturable():
                    self.capture(forward)

    def on_backend_change(self) -> None:
        """Captured collectives belong to the backend active at capture: recapture them all
        (every rank does this between the same two steps, so the captures pair up). A
        backend that does not declare ``capture_safe`` (start-up refuses it as the first one)
        gets no graphs: every forward runs eagerly until a capture-safe one is active again."""
        self.backend = self.comm.active_name if self.comm is not None else None
        self.info["allreduce"] = self.backend
        forwards = list(self.forwards.values())
        for forward in forwards:
            self._drop(forward.name)
        if not self.capturable():
            log.warning("allreduce backend '%s' is not CUDA-graph capture-safe: decode, draft "
                        "and verify run eagerly while it is active", self.backend)
            return
        for forward in forwards:
            self.capture(forward)

    def capturable(self) -> bool:
        """Whether the active backend's collectives may be captured (any backend at TP = 1)."""
        active = self.comm.active if self.comm is not None else None
        return active is None or active.world_size == 1 or bool(active.capture_safe)

    def _drop(self, name: str) -> None:
        self.spans.pop(name, None)
        for cap in self.graphs.pop(name, {}).values():
            for backend in cap.backends:
                backend.graph_release(cap.batch.attn)

    @torch.inference_mode()
    def capture(self, forward: StaticForward, progress: Callable[[str], None] = log.info) -> None:
        """Capture ``forward`` for every bucket (largest first, so later ones fit its pool).

        Under this executor's device as the current one: the current device is per thread,
        and a live recapture runs on rank 0's engine thread, not the thread that chose the
        device; torch makes its shared capture stream on the device current at the first
        capture (one device per process here)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            self._capture_all(forward, progress)

    def _capture_all(self, forward: StaticForward, progress: Callable[[str], None]) -> None:
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        self.forwards[forward.name] = forward
        graphs = self.graphs.setdefault(forward.name, {})
        spans = self.spans[forward.name] = self._plan_spans(forward)
        # Largest first (batch x keys): every later graph fits the pool the first one made.
        todo = sorted(((bs, k) for bs, ks in spans.items() for k in ks),
                      key=lambda shape: (shape[0] * shape[1], shape[0]), reverse=True)
        with _timing_off(self.comm):
            for i, (bs, k) in enumerate(todo):
                progress(f"capturing CUDA graph '{forward.name}' batch {bs}, {k} keys "
                         f"({i + 1}/{len(todo)})")
                graphs[(bs, k)] = self._capture_one(forward, bs, k)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        widths = sorted({k for ks in spans.values() for k in ks})
        self.info["sets"][forward.name] = {"graphs": len(graphs), "key_spans": widths,
                                         "capture_s": round(seconds, 3),
                                         "memory_mb": round(used / 2**20, 1)}
        log.info("captured %d '%s' graphs (key spans %s) in %.1fs using %.0f MB", len(graphs),
                 forward.name, "/".join(map(str, widths)), seconds, used / 2**20)

    def _plan_spans(self, forward: StaticForward) -> dict[int, tuple[int, ...]]:
        """Per batch bucket, the key spans to capture ``forward`` at. A forward whose attention
        reads the pages each replay's plan names (FlashInfer's decode) costs the same at any
        width: the widest alone. One that gathers the static width gets the span ladder,
        within the gather budget (``buckets.graph_spans``)."""
        widest = self.cfg.key_spans[-1]
        probe = inert_batch(1, forward.queries, widest // self.cfg.page_size, self.cfg.page_size,
                            self.device, self.cfg.mask_width.get(forward.name, 0))
        backends = forward.backends()
        if backends and all(b.graph_reads_in_place(probe.attn) for b in backends):
            return {bs: (widest,) for bs in self.cfg.batch_sizes}
        return graph_spans(self.cfg.batch_sizes, self.cfg.key_spans, self.cfg.gather_tokens)

    def _capture_one(self, forward: StaticForward, bs: int, span: int) -> _Captured:
        # The static page table holds ``span`` keys: the longest request the graph serves.
        fb = inert_batch(bs, forward.queries, span // self.cfg.page_size, self.cfg.page_size,
                         self.device, self.cfg.mask_width.get(forward.name, 0))
        extras = {k: torch.zeros(bs, forward.queries, *shape, dtype=dtype, device=self.device)
                  for k, (shape, dtype) in forward.extras.items()}
        backends = forward.backends()
        for backend in backends:  # host-side planning, before (and outside) the capture
            backend.graph_capture(fb.attn)
        graph, outputs = _record(forward, fb, extras, self.pool, self.device)
        return _Captured(graph, fb, extras, outputs, backends)


def _record(forward: StaticForward, fb: ForwardBatch, extras: dict[str, torch.Tensor],
            pool: Any, device: torch.device) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """Warm ``forward`` up and capture it: (the CUDA graph, its static outputs)."""
    # Warm up on a side stream: lazy initialisations (cuBLAS handles, NCCL communicators,
    # autotuning) must happen before capture, where they are not allowed.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward.fn(fb, extras)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward.fn(fb, extras)
    return graph, outputs


def _copy_inputs(static: ForwardBatch, fb: ForwardBatch) -> None:
    """Copy a (bucket-padded) batch into a graph's static inputs; the page table and the
    speculative mask are narrower than the static ones, whose other columns stay unread (a
    request's key count bounds what attention looks at)."""
    dst, src = static.attn, fb.attn
    static.input_ids.copy_(fb.input_ids, non_blocking=True)
    static.positions.copy_(fb.positions, non_blocking=True)
    for name in ("q_indptr", "kv_lens", "write_slots"):
        getattr(dst, name).copy_(getattr(src, name), non_blocking=True)
    # A plan's table is as wide as its longest page list, which may hold pages reserved past
    # the captured width (the speculative reserve near the context limit); attention never
    # reads them (``run`` checked every key count against the graph's key span).
    cols = min(src.page_table.shape[1], dst.page_table.shape[1])
    dst.page_table[:, :cols].copy_(src.page_table[:, :cols], non_blocking=True)
    if dst.custom_mask is not None and src.custom_mask is not None:
        width = src.custom_mask.shape[2]
        dst.custom_mask[:, :, :width].copy_(src.custom_mask, non_blocking=True)
        dst.custom_mask[:, :, width:].zero_()
        dst.mask_start.copy_(src.mask_start, non_blocking=True)


def _fits_mask(static: ForwardBatch, fb: ForwardBatch) -> bool:
    """Whether ``fb``'s speculative mask (if any) fits the captured one's width."""
    src, dst = fb.attn.custom_mask, static.attn.custom_mask
    if src is None:
        return True
    return dst is not None and src.shape[2] <= dst.shape[2]


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
