"""Start-up wiring for fixed-shape execution: which executor, which buckets, how much memory.

GPU: CUDA graphs unless ``--disable-cuda-graph``; TP > 1 needs a capture-safe allreduce
backend and otherwise refuses to start (running some forwards eagerly would silently cost the
speed the user asked for; the error names the fix). CPU: ``--compile`` enables the
torch.compile executor. Both use the same batch buckets (``--cuda-graph-bs`` or the defaults
up to ``--cuda-graph-max-bs``).

Memory: ``graph_reserve_bytes`` estimates what capture will take (peak activations of the
largest bucket, shared through one pool, plus every graph's resident outputs) so the KV
cache is sized after it; raising ``--cuda-graph-max-bs`` therefore visibly trades KV pages.
A ``torch`` forward gathers keys up to the context limit in its widest graph, so its
estimate grows with the context, and it is captured at every key span (``buckets.key_spans``),
each graph keeping its outputs; FlashInfer's decode graphs gather nothing (their wrappers'
buffers are counted instead) and take one span, so without speculation a long context costs
graphs no more than a short one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tpserve.args import ServerArgs
from tpserve.dist import CommSwitch
from tpserve.engine.buckets import (
    Buckets,
    default_batch_sizes,
    graph_spans,
    key_spans,
    round_up,
)
from tpserve.engine.static_forward import StaticForward
from tpserve.errors import ConfigError
from tpserve.layers.attention.registry import unavailable_reason

log = logging.getLogger(__name__)

# Positions the rotary tables (and so key spans) reach past the context: speculative tree
# nodes are written there before acceptance. One constant for every builder.
ROTARY_HEADROOM = 64
GRAPH_OVERHEAD = 1 << 20  # bytes per captured graph beyond its tensors (rough)
# FlashInfer allocates an int workspace of this size on the device per decode wrapper (one per
# bucket), beside the page-index buffers the buckets share.
FLASHINFER_WRAPPER_BYTES = 8 << 20
# What one gathering graph may hold of one layer's gathered keys and values (with the copies
# _activation_bytes counts): above it a bucket keeps only its narrowest key span, so a long
# context limit at a large batch bucket does not take the KV cache's memory at start-up
# (DeepSeek-V3's MLA at 160K keys and bucket 64 would reserve ~48 GB of a GPU).
GRAPH_GATHER_BYTES = 2 << 30
# Backends whose decode graphs read the pages a replay plans (one graph a bucket, no gather).
IN_PLACE_DECODE = ("flashinfer", "flashinfer_mla")


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    inter_local: int
    heads_local: int
    kv_heads_local: int
    head_dim: int
    itemsize: int
    attention: str = "torch"  # the model's attention backend (what decode graphs replay)

    @staticmethod
    def of(model: Any, dtype: torch.dtype) -> ModelShape:
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        backend = getattr(model, "attention", None)
        return ModelShape(model.lm_head.per_rank * model.tp.size, model.cfg.hidden_size,
                          mlp.inter_local, attn.heads, attn.kv_heads, attn.head_dim,
                          dtype.itemsize, getattr(backend, "name", "torch"))


def batch_sizes(args: ServerArgs) -> tuple[int, ...]:
    if args.cuda_graph_bs:
        return tuple(sorted(set(args.cuda_graph_bs)))
    return default_batch_sizes(args.cuda_graph_max_bs or args.max_running_requests)


def max_keys(context_length: int, page_size: int) -> int:
    return round_up(context_length + ROTARY_HEADROOM, page_size)


def uses_graphs(args: ServerArgs, device: torch.device) -> bool:
    return device.type == "cuda" and not args.disable_cuda_graph


def forward_queries(args: ServerArgs) -> tuple[int, ...]:
    """Q of every captured forward: decode, then draft (topk) and verify (draft tokens)."""
    if not args.speculative_algorithm:
        return (1,)
    return (1, args.speculative_eagle_topk, args.speculative_num_draft_tokens)


def gather_tokens(shape: ModelShape) -> int:
    """Most bucket x key span a gathering graph may hold (``buckets.graph_spans``): its
    gathered keys (and values, and their copies) within ``GRAPH_GATHER_BYTES``."""
    return max(1, GRAPH_GATHER_BYTES // _gathered_per_key(shape))


def graph_reserve_bytes(args: ServerArgs, shape: ModelShape, context_length: int,
                        device: torch.device) -> int:
    """Estimated CUDA-graph memory: shared-pool peak + resident outputs + per-graph overhead."""
    if not uses_graphs(args, device):
        return 0
    sizes, keys = batch_sizes(args), max_keys(context_length, args.page_size)
    in_place = shape.attention in IN_PLACE_DECODE
    ladder = graph_spans(sizes, key_spans(keys, args.page_size), gather_tokens(shape))

    def graphs_of(q: int) -> list[tuple[int, int]]:
        """(bucket, keys gathered) of each graph of the forward with ``q`` queries: FlashInfer's
        decode (GQA or MLA) reads pages in place (one graph a bucket); the others gather at
        their spans."""
        if in_place and q == 1:
            return [(b, 0) for b in sizes]
        return [(b, k) for b, spans in ladder.items() for k in spans]

    every = {q: graphs_of(q) for q in forward_queries(args)}
    peak = max(_activation_bytes(shape, b, q, k) for q, gs in every.items() for b, k in gs)
    out_row = shape.vocab * 4 + shape.hidden * shape.itemsize  # each graph keeps its outputs
    outputs = sum(b * q * out_row for q, gs in every.items() for b, _ in gs)
    wrappers = 0
    if in_place:
        wrappers = FLASHINFER_WRAPPER_BYTES * len(sizes) + sizes[-1] * (keys // args.page_size) * 4
    return peak + outputs + wrappers + GRAPH_OVERHEAD * sum(len(gs) for gs in every.values())


def _gathered_per_key(s: ModelShape) -> int:
    return 4 * s.kv_heads_local * s.head_dim * s.itemsize  # K, V (+ copies)


def _activation_bytes(s: ModelShape, batch: int, queries: int, keys: int) -> int:
    tokens = batch * queries
    logits = tokens * s.vocab * (4 + s.itemsize)  # model-dtype logits, then float32
    gathered = batch * keys * _gathered_per_key(s)
    scores = batch * s.heads_local * queries * keys * 4  # masked SDPA materialises scores
    mlp = 3 * tokens * s.inter_local * s.itemsize
    return logits + gathered + scores + mlp


def capture_unsafe_reason(comm: CommSwitch | None, world_size: int) -> str | None:
    if comm is None or world_size == 1:
        return None  # a single rank never communicates: any backend is fine
    if not comm.active.capture_safe:
        return (f"allreduce backend '{comm.active_name}' is not CUDA-graph capture-safe; use "
                "a capture-safe backend (nccl, cuda_p2p, symm_mem) or --disable-cuda-graph")
    return None


def make_executor(args: ServerArgs, forwards: list[StaticForward], device: torch.device,
                  comm: CommSwitch | None, world_size: int, context_length: int,
                  shape: ModelShape | None = None) -> Any:
    """Build (and on GPU capture) the executor for ``forwards``; None when running eagerly.
    ``shape`` sets the gather budget of the graphs (none without it)."""
    sizes = batch_sizes(args)
    if uses_graphs(args, device):
        from tpserve.engine.graphs import CudaGraphExecutor, GraphConfig

        reason = capture_unsafe_reason(comm, world_size)
        if reason is not None:
            raise ConfigError(reason, "--allreduce")
        widths = {"verify": args.speculative_num_draft_tokens,
                  "draft": max(1, (args.speculative_num_steps - 1) * args.speculative_eagle_topk)}
        keys = max_keys(context_length, args.page_size)
        executor = CudaGraphExecutor(
            GraphConfig(sizes, keys, args.page_size, widths, key_spans(keys, args.page_size),
                        gather_tokens(shape) if shape is not None else None),
            device, comm)
        for forward in forwards:
            executor.capture(forward)
        return executor
    if args.compile and device.type == "cpu":
        from tpserve.engine.compiled import CompileConfig, CompiledExecutor

        if world_size > 1:
            # Every collective breaks the graph, and the pieces after a break are compiled
            # with static shapes (the page table's width too), so they recompile as contexts
            # grow: measured on the demo pair, batch 1, 0.19x of the eager default.
            log.warning("--compile at TP = %d: the compiled pieces between collectives "
                        "recompile as contexts grow; on the demo pair it decoded at ~0.2x of "
                        "the default eager path", world_size)
        cfg = CompileConfig(Buckets(sizes), args.compile_mode, fullgraph=world_size == 1)
        return CompiledExecutor(forwards, cfg)
    if args.compile:
        raise ConfigError(f"--compile is for CPU; on {device.type} decode is captured as CUDA "
                          "graphs (the default; --disable-cuda-graph runs it eagerly)",
                          "--compile")
    return None


def graph_attention_line(requested: str, backend: Any, device: torch.device) -> str:
    """One log line: the attention backend CUDA graphs replay and what that means for the
    key span; when ``auto`` fell back to ``torch``, why FlashInfer could not run."""
    name = getattr(backend, "name", type(backend).__name__)
    if name == "flashinfer":
        why = ("decode graphs replay FlashInfer's CUDA-graph decode over the pages each step "
               "uses; draft/verify graphs gather with torch, at the narrowest captured key "
               "span that holds the step")
    elif name == "flashinfer_mla":
        why = ("MLA decode graphs replay FlashInfer's paged MLA kernel over the pages each step "
               "uses; other steps gather with torch, at the narrowest captured key span")
    elif name == "torch":
        reason = None
        if requested == "auto":
            reason = unavailable_reason("flashinfer", backend.spec, device)
        why = (reason or f"--attention-backend {requested}") + (
            "; each replayed step gathers keys at the narrowest captured key span that "
            "holds it (4096 keys up by 4x to the context limit)")
    else:
        why = "the model's own attention, gathered at the narrowest captured key span"
    return f"CUDA graphs: attention backend '{name}' ({why})"


def install_static(args: ServerArgs, runner: Any, spec: Any, world_size: int,
                   context_length: int) -> None:
    """Set ``runner.static`` (shared by the speculative decoder) and its report."""
    forwards = [runner.decode_forward]
    if spec is not None:
        forwards += [spec.drafter.draft_forward, spec.drafter.verify_forward]
    shape = ModelShape.of(runner.model, runner.kv.cfg.dtype)
    executor = make_executor(args, forwards, runner.device, runner.comm, world_size,
                             context_length, shape)
    runner.static = executor
    # The executor's own dict: compile times recorded later show up live.
    runner.graph_info = executor.info if executor is not None else {"kind": "eager"}
    if uses_graphs(args, runner.device):
        backend = runner.model.attention
        log.info(graph_attention_line(args.attention_backend, backend, runner.device))
        runner.graph_info["attention"] = getattr(backend, "name", type(backend).__name__)
    if executor is not None:
        reserved = graph_reserve_bytes(args, shape, context_length, runner.device)
        runner.graph_info["reserved_mb"] = round(reserved / 2**20, 1)
