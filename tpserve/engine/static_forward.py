"""The fixed-shape forwards that CUDA graphs capture and torch.compile compiles.

A ``StaticForward`` is a pure function of a padded ``ForwardBatch`` plus per-row extra inputs, with
every output flattened to [B * Q, ...] rows so an executor can pad, run, and slice the real
rows back out. The three static forwards are the hot loops of decoding:

- ``decode``: target forward over one token per request -> logits, final hidden;
- ``draft``: one EAGLE-3 draft step over K beam nodes -> draft output, draft log-probs;
- ``verify``: target forward over the N tree nodes -> logits, fc'd aux features.

Executors (``graphs.CudaGraphExecutor``, ``compiled.CompiledExecutor``) share the
``StaticExecutor`` protocol; ``run`` returns None when no bucket fits (the caller then runs
the same forward eagerly, which is also how the reference outputs in tests are produced).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tpserve.engine.buckets import pad_rows
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.layers.attention.base import GraphPlanned

log = logging.getLogger(__name__)

ForwardFn = Callable[[ForwardBatch, dict[str, torch.Tensor]], tuple[torch.Tensor, ...]]
BackendsFn = Callable[[], tuple[GraphPlanned, ...]]


def _no_backends() -> tuple[GraphPlanned, ...]:
    return ()


def attention_of(model: Any) -> BackendsFn:
    """The attention backend ``model`` has when asked (a live change may replace it), where it
    plans on the host around CUDA graphs (``GraphPlanned``); the ``mla`` backend, whose
    preparation is all device work, has nothing for the executor to do."""
    def backends() -> tuple[GraphPlanned, ...]:
        backend = getattr(model, "attention", None)
        return (backend,) if isinstance(backend, GraphPlanned) else ()

    return backends


@dataclass(frozen=True)
class StaticForward:
    name: str
    queries: int  # Q: tokens per request row
    fn: ForwardFn
    # extra input name -> (trailing shape after [B, Q], dtype); padded rows are zeros
    extras: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    # attention backends the forward prepares: a graph executor gives them their host-side
    # hooks (graph_capture / graph_replan), since a replay runs no Python
    backends: BackendsFn = _no_backends


class StaticExecutor(Protocol):
    info: dict[str, Any]  # capture / compile report, merged into /get_server_info

    def run(self, name: str, fb: ForwardBatch,
            extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...] | None: ...


def decode_forward(model: Any, kv_layers: list[Any]) -> StaticForward:
    # A model may run its whole step, head included, natively (LlamaForCausalLM on CPU).
    fused = getattr(model, "forward_logits", None)

    def decode(fb: ForwardBatch, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = fused(fb, kv_layers) if fused is not None else None
        if out is not None:
            return out
        hidden, _ = model(fb, kv_layers)
        return model.logits(hidden), hidden

    return StaticForward("decode", 1, decode, backends=attention_of(model))


def verify_forward(model: Any, kv_layers: list[Any], draft: Any, aux_sorted: tuple[int, ...],
                   aux_order: list[int], num_nodes: int) -> StaticForward:
    def verify(fb: ForwardBatch, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        hidden, aux = model(fb, kv_layers, aux_sorted)
        feats = draft.project(torch.cat([aux[i] for i in aux_order], dim=-1))
        return model.logits(hidden), feats

    return StaticForward("verify", num_nodes, verify, backends=attention_of(model))


def draft_forward(draft: Any, embed: Any, cache: Any, topk: int, hidden_size: int,
                  dtype: torch.dtype) -> StaticForward:
    def draft_step(fb: ForwardBatch, extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        hidden = extras["hidden"].reshape(-1, hidden_size)
        out = draft(embed(fb.input_ids.reshape(-1)), hidden, fb, cache)
        return out, torch.log_softmax(draft.logits(out), dim=-1)

    return StaticForward("draft", topk, draft_step, {"hidden": ((hidden_size,), dtype)},
                         attention_of(draft))


def run_static(executor: StaticExecutor | None, forward: StaticForward, fb: ForwardBatch,
               extras: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The executor's fixed-shape run when a bucket fits, else the eager forward.

    Every run is counted in the executor's report (``static_runs`` / ``eager_fallbacks`` per
    forward), and the first fallback of each forward is logged: a batch that silently runs
    eagerly is a speed the user asked for and did not get.
    """
    if executor is None:
        return forward.fn(fb, extras)
    out = executor.run(forward.name, fb, extras)
    counts = executor.info.setdefault("static_runs" if out is not None else "eager_fallbacks", {})
    counts[forward.name] = counts.get(forward.name, 0) + 1
    if out is not None:
        return out
    if counts[forward.name] == 1:
        log.warning("'%s' ran eagerly: no captured/compiled bucket fits batch %d x %d queries "
                    "(buckets: %s); counted in eager_fallbacks", forward.name, fb.batch_size,
                    fb.queries, executor.info.get("batch_sizes"))
    return forward.fn(fb, extras)


def pad_extras(extras: dict[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    return {k: pad_rows(v, batch) for k, v in extras.items()}
