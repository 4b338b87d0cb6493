"""CPU decode through torch.compile, bucketed by batch size.

Why it helps at small batch on CPU: an eager decode step dispatches ~40 ATen ops per layer
(norm casts, rotary gathers, splits, residual adds) each costing microseconds of Python and
dispatcher overhead, while the matmuls themselves read only ~6 MB per layer. Inductor fuses
the elementwise chains into a few C++ loops and replaces the per-op dispatch with one call.

Batch shapes are fixed per bucket (``dynamic=False``, requests padded inertly). The page
table's width is a symbolic dimension (``mark_dynamic``): attention reads it in place and
never sizes a matmul with it, so one compilation per (forward, B) serves every context length.
No ``.item()`` / numpy runs inside a forward, so a forward is one graph (``fullgraph`` at
TP = 1; at TP > 1 each allreduce is a graph break that runs eagerly between compiled pieces).

Outputs must not change. Inductor keeps every op that rounds where eager rounds
(``emulate_precision_casts``), does not fold "residual + x @ W" into one addmm
(``pattern_matcher`` off), and reductions whose order matters run as opaque ops that eager
calls too (``tpserve::mean_square`` in RMSNorm, ``tpserve::matmul`` for CPU projections,
``tpserve::paged_attention``), so only pointwise chains are fused. Tests and
launch/bench_compile.py check greedy tokens are identical to eager (bf16 included).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from tpserve.engine.buckets import Buckets, inert_batch, pad_forward_batch
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.static_forward import StaticForward, pad_extras

log = logging.getLogger(__name__)

MODES = ("default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileConfig:
    buckets: Buckets
    mode: str = "default"
    # Freezing lets inductor pre-pack weights for oneDNN (constant-folds parameters), at the
    # cost of a second copy of the weights; off by default, see launch/bench_compile.py.
    freezing: bool = False
    fullgraph: bool = True  # False at TP > 1: allreduces break the graph
    backend: str = "inductor"  # "eager": dynamo tracing + bucketing only (tests, debugging)

    def options(self) -> dict[str, Any]:
        # pattern_matcher off: its post-grad pass folds "residual + x @ W" into one addmm,
        # which rounds once where eager rounds the matmul and the add separately (bf16
        # greedy tokens then drift from eager). Fusing elementwise chains is unaffected.
        return {"freezing": self.freezing, "emulate_precision_casts": True,
                "pattern_matcher": False}


class CompiledExecutor:
    """``StaticExecutor`` over torch.compile'd forwards (CPU)."""

    def __init__(self, forwards: list[StaticForward], cfg: CompileConfig) -> None:
        if cfg.mode not in MODES:
            raise ValueError(f"compile mode '{cfg.mode}' is not one of {', '.join(MODES)}")
        self.cfg = cfg
        self.forwards = {p.name: p for p in forwards}
        # mode and options are mutually exclusive in torch.compile: fold the mode's own
        # switch into options.
        opts = {**cfg.options(), "max_autotune": cfg.mode != "default"}
        kwargs: dict[str, Any] = {"options": opts} if cfg.backend == "inductor" else {}
        self.compiled = {p.name: torch.compile(p.fn, dynamic=False, fullgraph=cfg.fullgraph,
                                               backend=cfg.backend, **kwargs) for p in forwards}
        self._seen: set[tuple[str, int]] = set()
        self.info: dict[str, Any] = {
            "kind": "torch.compile", "backend": cfg.backend, "mode": cfg.mode,
            "freezing": cfg.freezing, "batch_sizes": list(cfg.buckets.batch_sizes),
            "compile_s": 0.0, "compiled": {}}

    def run(self, name: str, fb: ForwardBatch,
            extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
        spec = self.forwards.get(name)
        bucket = self.cfg.buckets.pick(fb.batch_size) if spec is not None else None
        if spec is None or bucket is None or fb.queries != spec.queries:
            return None
        padded = pad_forward_batch(fb, bucket)
        padded_extras = {k: v.contiguous() for k, v in pad_extras(extras, bucket).items()}
        # The page table's width follows the longest request: one graph serves them all.
        torch._dynamo.maybe_mark_dynamic(padded.attn.page_table, 1)
        key = (name, bucket)
        if key in self._seen:
            out = self.compiled[name](padded, padded_extras)
        else:
            out = self._first_call(key, padded, padded_extras)
        rows = fb.batch_size * spec.queries
        return tuple(o[:rows] for o in out)

    def refresh(self, forwards: list[StaticForward]) -> None:
        """Swap in rebuilt forwards (a live speculative change); their buckets recompile lazily."""
        for forward in forwards:
            if forward.name not in self.forwards:
                continue
            self.forwards[forward.name] = forward
            self.compiled[forward.name] = torch.compile(
                forward.fn, dynamic=False, fullgraph=self.cfg.fullgraph, backend=self.cfg.backend,
                **({"options": {**self.cfg.options(), "max_autotune": self.cfg.mode != "default"}}
                   if self.cfg.backend == "inductor" else {}))
            self._seen = {k for k in self._seen if k[0] != forward.name}

    def _first_call(self, key: tuple[str, int], fb: ForwardBatch,
                    extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Compile bucket ``key``: timed, logged, reported in ``info``."""
        limit = len(self.cfg.buckets.batch_sizes) + 8
        start = time.perf_counter()
        # Every bucket is its own specialisation of the same code object; dynamo's default
        # limit (8) would silently fall back to eager past it.
        with torch._dynamo.config.patch(recompile_limit=limit,
                                        accumulated_recompile_limit=max(256, 4 * limit)):
            out = self.compiled[key[0]](fb, extras)
        seconds = time.perf_counter() - start
        self._seen.add(key)
        self.info["compile_s"] += seconds
        self.info["compiled"][f"{key[0]}/B{key[1]}"] = round(seconds, 3)
        log.info("compiled %s for batch %d in %.1fs", key[0], key[1], seconds)
        return out

    @torch.inference_mode()
    def warmup(self, name: str, batch_sizes: tuple[int, ...], page_size: int,
               device: torch.device) -> None:
        """Compile buckets ahead of traffic with all-inert batches (they touch page 0 only)."""
        spec = self.forwards[name]
        for b in batch_sizes:
            fb = inert_batch(b, spec.queries, 1, page_size, device)
            extras = {k: torch.zeros(b, spec.queries, *shape, dtype=dtype, device=device)
                      for k, (shape, dtype) in spec.extras.items()}
            self.run(name, fb, extras)
