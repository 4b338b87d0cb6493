"""MLA decode through FlashInfer's paged MLA kernel (``BatchMLAPagedAttentionWrapper``), CUDA.

The ``mla`` backend (``mla_attention``) gathers every request's latents into a [B, T, 576]
tensor padded to the batch's longest request (in a CUDA graph: to the graph's key span), so
one long request makes every row of the batch pay for its context. FlashInfer's kernel reads
the pages in place: a decode step costs the pages its requests use.

- Our cache [slots, 1, C + R] viewed as [pages, page_size, C + R] holds the kernel's two
  caches as strided views: ``ckv`` = the first C values of each slot, ``kpe`` = the last R.
- A step without a speculative mask (decode, prefill chunks, mixed steps: causal), and an
  eager chain verify (``--speculative-eagle-topk 1``, the default: its mask is causal), is
  planned on the host from the page table (O(pages used)) and runs the absorbed form, also
  where the model asks for ``expanded`` (the kv_b_proj halves are applied around the kernel);
  tree verifies (topk > 1) and verify graphs go through the ``mla`` backend.
- CUDA graphs: a decode graph gets a graph-mode wrapper of its batch size over fixed buffers
  (``flashinfer_graphs.DecodeGraphWrappers``), planned at capture and before each replay
  (``graph_capture`` / ``graph_replan``), so a replayed step reads only its own pages and the
  graph is captured at one key span (``graph_reads_in_place``).

FlashInfer's kernels are built for DeepSeek-V3 / Kimi-K2's latent (C = 512, R = 64) in 16-bit
types. ``mla_flashinfer_agrees`` runs a small decode through the kernel and through the ``mla``
backend once per device; where it fails or disagrees the model keeps the ``mla`` backend and
logs why (``choose_mla_backend``), so a library that behaves differently from what is modelled
here costs speed, not answers. ``tests/test_mla_flashinfer.py`` checks it on a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from comm_backends.base import job_min
from tpserve.layers.attention.flashinfer_backend import WORKSPACE_BYTES, paged_layout
from tpserve.layers.attention.flashinfer_graphs import DecodeGraphWrappers
from tpserve.layers.attention.metadata import AttentionMetadata, build_metadata
from tpserve.layers.mla_attention import BoundMLA, MLABackend

log = logging.getLogger(__name__)

KV_LORA_RANK, ROPE_DIM = 512, 64  # the latent FlashInfer's MLA kernels are built for
DTYPES = (torch.float16, torch.bfloat16)
AGREE_TOLERANCE = 0.02  # of the reference's largest value: bf16 rounding of two summations
# Limits of the kernels as read in FlashInfer's source (scheduler.cuh MLAPlan, mla_hopper.cuh):
# the plan's per-work arrays hold 16384 entries, unchecked; work tiles pack 64 (query row x
# head) pairs; page offsets into a layer's cache and query offsets are 32-bit. A step or a
# cache past them goes through the mla backend instead.
MAX_WORKS, TILE_ROWS, INDEX_LIMIT = 16384, 64, 2**32


def unavailable_reason(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype,
                       device: torch.device) -> str | None:
    """None where FlashInfer's MLA kernel can serve this latent, else one line why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "needs a CUDA device"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python is not installed (pip install 'tpserve[gpu]')"
    if (kv_lora_rank, rope_dim) != (KV_LORA_RANK, ROPE_DIM):
        return f"its kernels take a {KV_LORA_RANK} + {ROPE_DIM} latent, not {kv_lora_rank} + {rope_dim}"
    if dtype not in DTYPES:
        return f"KV cache dtype {dtype} is not fp16/bf16"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "needs compute capability 8.0 or newer"
    return None


def _causal(meta: AttentionMetadata) -> bool:
    """A step the kernel serves: anything without a speculative mask (decode, prefill chunks
    and mixed steps: each request's query rows are the last of its keys, causally), and a
    chain's verify, whose mask is that same causal one (``mask_is_causal``)."""
    return meta.custom_mask is None or meta.mask_is_causal


@dataclass(frozen=True)
class FlashInferBoundMLA:
    """One plain decode step's planned MLA attention, handed to every layer (``BoundMLA``'s
    interface)."""

    meta: AttentionMetadata
    wrapper: Any  # planned for this step (or, in a graph, before each replay)
    fallback: MLABackend
    kv_lora_rank: int

    @property
    def max_q_len(self) -> int:
        return self.meta.max_q_len

    def absorbed(self, q_latent: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q_latent [N, H, C], q_pe [N, H, R], latent [N, C + R] -> [N, H, C]. ``scale`` was
        given to the plan (the kernel takes it there)."""
        if cache.numel() >= INDEX_LIMIT:  # a few-layer model with a huge pool
            return self.fallback.bind(self.meta).absorbed(q_latent, q_pe, latent, cache, scale)
        cache[self.meta.write_slots] = latent.unsqueeze(1).to(cache.dtype)
        paged = cache.view(-1, self.meta.page_size, cache.shape[-1])
        c = self.kv_lora_rank
        out = self.wrapper.run(q_latent.to(cache.dtype).contiguous(),
                               q_pe.to(cache.dtype).contiguous(), paged[..., :c], paged[..., c:])
        return out.to(q_latent.dtype)

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                 cache: torch.Tensor, scale: float, w_uk: torch.Tensor,
                 w_uv: torch.Tensor) -> torch.Tensor:
        """``BoundMLA.expanded``'s result through the absorbed kernel: the key half of
        kv_b_proj folded into the queries, the value half applied to the output. The torch
        form would expand every request's latents into per-head keys and values up to the
        batch's longest request, with a [B, Q, T] mask: a prefill chunk beside long-running
        requests then takes tens of GB."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, C]
        out = self.absorbed(q_latent, q_pe, latent, cache, scale)
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class FlashInferMLA:
    """Prepares a step once for every MLA layer: FlashInfer for every step without a
    speculative mask and for a chain's verify (``_causal``), else ``mla``."""

    name = "flashinfer_mla"

    def __init__(self, latent_dim: int, kv_lora_rank: int, heads: int, scale: float,
                 dtype: torch.dtype, device: torch.device, flashinfer: Any = None) -> None:
        if flashinfer is None:
            import flashinfer
        self.kv_lora_rank, self.heads, self.scale, self.dtype = kv_lora_rank, heads, scale, dtype
        self.rope_dim = latent_dim - kv_lora_rank
        self.fallback = MLABackend(latent_dim, dtype, device)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper
        self._eager = wrapper(workspace)

        def graph_wrapper(paged_kv_indptr_buffer: torch.Tensor,
                          paged_kv_indices_buffer: torch.Tensor,
                          paged_kv_last_page_len_buffer: torch.Tensor) -> Any:
            # The per-request buffer holds key counts here (the kernel's kv_len_arr); the
            # query offsets of a decode batch are 0..B, fixed for the wrapper's batch size.
            batch = paged_kv_last_page_len_buffer.numel()
            qo = torch.arange(batch + 1, dtype=torch.int32, device=device)
            return wrapper(workspace, use_cuda_graph=True, qo_indptr=qo,
                           kv_indptr=paged_kv_indptr_buffer, kv_indices=paged_kv_indices_buffer,
                           kv_len_arr=paged_kv_last_page_len_buffer)

        self._graphs = DecodeGraphWrappers(graph_wrapper, device)
        self._sms = (torch.cuda.get_device_properties(device).multi_processor_count
                     if device.type == "cuda" else 0)
        # id(static metadata) -> (it, its graph wrapper or None: the ``mla`` path)
        self._static: dict[int, tuple[AttentionMetadata, Any]] = {}
        self._captured_plans: dict[int, Any] = {}  # id(graph wrapper) -> its plan at capture

    def _plan(self, wrapper: Any, meta: AttentionMetadata) -> None:
        host = meta.host
        indptr, indices, _ = paged_layout(host.page_table, host.kv_lens, meta.page_size)
        wrapper.plan(torch.from_numpy(host.q_indptr.astype(np.int32)), indptr, indices,
                     torch.from_numpy(host.kv_lens.astype(np.int32)), self.heads,
                     self.kv_lora_rank, self.rope_dim, meta.page_size, meta.max_q_len > 1,
                     self.scale, self.dtype, self.dtype)

    def _fits(self, meta: AttentionMetadata) -> bool:
        """Whether the step's work stays within the plan's arrays and 32-bit query offsets."""
        q_lens = np.diff(meta.host.q_indptr.astype(np.int64))
        works = int((-(-q_lens * self.heads // TILE_ROWS)).sum()) + 2 * self._sms
        return works <= MAX_WORKS and meta.num_rows * self.heads * self.kv_lora_rank < INDEX_LIMIT

    def _bound(self, meta: AttentionMetadata, wrapper: Any) -> FlashInferBoundMLA:
        return FlashInferBoundMLA(meta, wrapper, self.fallback, self.kv_lora_rank)

    def bind(self, meta: AttentionMetadata) -> FlashInferBoundMLA | BoundMLA:
        entry = self._static.get(id(meta))
        if entry is not None and entry[0] is meta:  # a graph's static step: no host work
            return self.fallback.bind(meta) if entry[1] is None else self._bound(meta, entry[1])
        if not _causal(meta) or not self._fits(meta):
            return self.fallback.bind(meta)
        self._plan(self._eager, meta)
        return self._bound(meta, self._eager)

    # CUDA-graph hooks (``AttentionBackend``'s, which the graph executor calls)
    def graph_capture(self, static: AttentionMetadata) -> None:
        wrapper = None
        if static.is_plain_decode:
            wrapper = self._graphs.get(static.batch_size, int(static.page_table.shape[1]))
            # A plan for the longest rows the graph can serve, then the capture's own: if
            # their launch parameters differ, replays could not follow the layout.
            self._plan(wrapper, _longest(static))
            longest = _plan_key(wrapper)
            self._plan(wrapper, static)
            if _plan_key(wrapper) == longest:
                self._captured_plans[id(wrapper)] = longest
            else:
                log.warning("FlashInfer's MLA plan depends on the layout in this version: "
                            "decode graphs of batch %d attend through the mla backend",
                            static.batch_size)
                wrapper = None
        self._static[id(static)] = (static, wrapper)

    def graph_replan(self, static: AttentionMetadata, meta: AttentionMetadata) -> None:
        """Re-plan before a replay. The captured launch keeps the plan's host values (grid,
        offsets into the workspace), which FlashInfer keeps fixed for a fixed batch of decode
        rows, and the new schedule goes into the workspace. Should a version make them depend
        on the layout, a replay would read a stale plan: refuse loudly instead."""
        wrapper = self._static[id(static)][1]
        if wrapper is None:
            return
        self._plan(wrapper, meta)
        if _plan_key(wrapper) != self._captured_plans.get(id(wrapper)):
            raise RuntimeError("FlashInfer's MLA plan changed its launch parameters under a "
                               "CUDA graph (this flashinfer version does not keep them fixed): "
                               "serve with --disable-cuda-graph or --attention-backend torch")

    def graph_release(self, static: AttentionMetadata) -> None:
        self._static.pop(id(static), None)

    def graph_reads_in_place(self, static: AttentionMetadata) -> bool:
        return static.is_plain_decode


def _longest(static: AttentionMetadata) -> AttentionMetadata:
    """``static``'s batch with every row as long as its page table allows (page 0 throughout:
    only planned, never run)."""
    table = np.zeros_like(static.host.page_table)
    rows = static.batch_size
    return build_metadata(table, np.ones(rows, dtype=np.int32),
                          np.full(rows, table.shape[1] * static.page_size, dtype=np.int32),
                          static.page_size, static.page_table.device)


def _plan_key(wrapper: Any) -> Any:
    """The host values a captured launch keeps from the last plan (FlashInfer's plan_info)."""
    info = getattr(wrapper, "_plan_info", None)
    try:
        return tuple(int(x) for x in info)  # type: ignore[union-attr]
    except TypeError:
        return repr(info)


@functools.cache
def mla_flashinfer_agrees(device: torch.device, heads: int, dtype: torch.dtype) -> str | None:
    """None when FlashInfer's MLA kernel matches the ``mla`` backend on small random batches
    (two requests over fragmented pages, one longer than a page: decode, a mixed step, a
    chain's verify), else why not."""
    try:
        return _disagreement(FlashInferMLA(KV_LORA_RANK + ROPE_DIM, KV_LORA_RANK, heads,
                                           0.1, dtype, device), device)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the mla backend
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]


def _disagreement(backend: FlashInferMLA, device: torch.device) -> str | None:
    page, width = 16, KV_LORA_RANK + ROPE_DIM
    g = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.randn(8 * page, 1, width, generator=g).to(device, backend.dtype)
    kv_lens, pages = np.array([37, 5], dtype=np.int32), np.array([[5, 2, 7], [3, 0, 0]], np.int32)
    # a decode step, a mixed one (a prompt chunk), and a chain's verify (its causal mask)
    for q_lens, chain in (([1, 1], False), ([3, 1], False), ([4, 4], True)):
        q = np.array(q_lens, dtype=np.int32)
        mask = (torch.ones(2, 4, 4, dtype=torch.bool, device=device).tril() if chain else None)
        meta = build_metadata(pages, q, kv_lens, page, device,
                              mask_start=kv_lens - q if chain else None, custom_mask=mask,
                              mask_is_causal=chain)
        rows, heads = meta.num_rows, backend.heads
        q_latent = torch.randn(rows, heads, KV_LORA_RANK, generator=g).to(device, backend.dtype)
        q_pe = torch.randn(rows, heads, ROPE_DIM, generator=g).to(device, backend.dtype)
        latent = torch.randn(rows, width, generator=g).to(device, backend.dtype)
        bound = backend.bind(meta)
        if not isinstance(bound, FlashInferBoundMLA):
            return f"query lengths {q_lens} were not given to the kernel"
        got = bound.absorbed(q_latent, q_pe, latent, cache.clone(), backend.scale)
        ref = backend.fallback.bind(meta).absorbed(q_latent, q_pe, latent, cache.clone(),
                                                  backend.scale)
        err = float((got.float() - ref.float()).abs().max())
        limit = AGREE_TOLERANCE * float(ref.float().abs().max())
        if err > limit:
            return (f"differs from the mla backend by {err:.3g} (limit {limit:.3g}) at query "
                    f"lengths {q_lens}")
    return None


def _refused_elsewhere(usable_here: bool) -> str | None:
    """Every rank must pick the same MLA backend: their decode graphs (one key span, or the
    ladder) and so the collectives they capture follow it. None when every rank can use the
    kernel (a CPU-side MIN over the job; only on CUDA, where every rank of a job asks)."""
    return None if job_min(int(usable_here)) else "another rank cannot run it"


def choose_mla_backend(requested: str, latent_dim: int, kv_lora_rank: int, rope_dim: int,
                       heads: int, scale: float, dtype: torch.dtype, device: torch.device
                       ) -> FlashInferMLA | MLABackend:
    """FlashInfer's kernel for ``auto`` / ``flashinfer`` where it can run and agrees on this
    device; otherwise the ``mla`` backend (logged with the reason where CUDA was asked)."""
    if requested not in ("auto", "flashinfer"):
        return MLABackend(latent_dim, dtype, device)
    reason = unavailable_reason(kv_lora_rank, rope_dim, dtype, device)
    if reason is None:
        reason = mla_flashinfer_agrees(device, heads, dtype)
    if device.type == "cuda":  # every rank takes part, whatever it found itself
        elsewhere = _refused_elsewhere(reason is None)
        reason = reason or elsewhere
    if reason is None:
        return FlashInferMLA(latent_dim, kv_lora_rank, heads, scale, dtype, device)
    if device.type == "cuda":
        log.info("MLA attention: the mla backend (FlashInfer's MLA kernel: %s)", reason)
    return MLABackend(latent_dim, dtype, device)
