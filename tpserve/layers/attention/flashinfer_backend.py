"""The ``flashinfer`` attention backend (CUDA): FlashInfer's paged kernels over tpserve's cache.

Layout: our flat cache [slots, Hk, D] viewed as [num_pages, page_size, Hk, D] is the same memory
as FlashInfer's NHD paged layout, and a request's pages are its page-table row, so per step
``prepare`` only turns the page table into FlashInfer's (indptr, indices, last_page_len) on the
host (O(pages used)) and plans once for every layer:

- decode (one query per request, causal): ``BatchDecodeWithPagedKVCacheWrapper``;
- causal query blocks (prefill chunks, mixed steps): ``BatchPrefillWithPagedKVCacheWrapper``;
- speculative steps (custom mask), as two parts merged by their log-sum-exp
  (``flashinfer.merge_state``), so nothing grows with context: the committed prefix
  [0, mask_start) through the paged prefill wrapper without a mask, and the M tree keys
  [mask_start, mask_start + M) through the ragged wrapper with the [q_len, M] masks (M is the
  draft/verify size). FlashInfer places query i of a request at kv_len - q_len + i of the keys it
  is given; with kv_lens == mask_start + M (true of draft and verify steps) that is exact for the
  tree part and off by M for the prefix, which the prefix's window_left absorbs.

CUDA graphs (``base.AttentionBackend.graph_capture``): a decode graph gets a graph-mode decode
wrapper of its batch size (``flashinfer_graphs``), planned on the host at capture and before
every replay with the step's real layout, so a replayed step reads only its own pages. The
two-part tree path plans and gathers on the host, which a graph cannot replay, so speculative
(draft / verify) graphs attend through the ``torch`` backend (gather + SDPA over the static page
table, as wide as the context limit); eager speculative steps keep the FlashInfer tree path.

``flashinfer`` is imported only when this backend is built (``pip install tpserve[gpu]``).
The wrappers keep the step's plan, so one backend instance serves one model (the draft model
gets its own) and a step must be prepared before its layers run.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpserve.layers.attention.base import AttentionBackend, AttentionSpec, KVPair, PreparedStep
from tpserve.layers.attention.flashinfer_graphs import DecodeGraphWrappers
from tpserve.layers.attention.metadata import AttentionMetadata
from tpserve.layers.attention.torch_backend import TorchAttention

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k workspace
HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FlashInferStep(PreparedStep):
    kind: str  # "decode" | "prefill" | "tree" | "graph_decode" | "graph_torch"
    generation: int  # the backend's plan counter when this step was planned
    tree_slots: torch.Tensor | None = None  # [B * M] int64 slots of the tree keys
    has_prefix: bool = True  # tree steps: some request has keys below mask_start
    wrapper: Any = None  # graph_decode: the bucket's graph-mode wrapper (replanned per replay)
    inner: PreparedStep | None = None  # graph_torch: the torch backend's step


def paged_layout(page_table: np.ndarray, kv_lens: np.ndarray, page_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's (kv_indptr [B+1], kv_indices [pages used], last_page_len [B]), int32 CPU."""
    pages = -(-kv_lens.astype(np.int64) // page_size)
    indptr = np.zeros(len(kv_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(page_table.shape[1])[None, :] < pages[:, None]
    last = np.where(pages > 0, kv_lens - (pages - 1) * page_size, 0).astype(np.int32)
    return (torch.from_numpy(indptr), torch.from_numpy(page_table[used].astype(np.int32)),
            torch.from_numpy(last))


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    @classmethod
    def unavailable_reason(cls, spec: AttentionSpec, device: torch.device) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return "needs a CUDA device"
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer-python is not installed (pip install 'tpserve[gpu]')"
        if spec.dtype not in DTYPES:
            return f"KV cache dtype {spec.dtype} is not fp16/bf16"
        if spec.head_dim not in HEAD_DIMS:
            return f"head_dim {spec.head_dim} is not one of {HEAD_DIMS}"
        if spec.num_q_heads % spec.num_kv_heads:
            return "query heads must be a multiple of KV heads"
        return None

    def __init__(self, spec: AttentionSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        import flashinfer

        self._fi = flashinfer
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        group = spec.num_q_heads // spec.num_kv_heads
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=group >= 4)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace, "NHD")
        self._generation = 0
        self._graphs = DecodeGraphWrappers(functools.partial(
            flashinfer.BatchDecodeWithPagedKVCacheWrapper, self._workspace, "NHD",
            use_tensor_cores=group >= 4, use_cuda_graph=True), device)
        # id(static metadata) -> (it, its decode wrapper or None: the torch path). Keyed by
        # identity because a replay's prepare() sees exactly the object captured.
        self._static: dict[int, tuple[AttentionMetadata, Any]] = {}
        self._torch: TorchAttention | None = None

    def _common(self) -> dict[str, Any]:
        s = self.spec
        return dict(sm_scale=s.scale, q_data_type=s.dtype, kv_data_type=s.dtype)

    def _window_left(self, shift: int = 0) -> int:
        return self.spec.window - 1 - shift if self.spec.window else -1

    def _heads(self, page_size: int) -> tuple[int, int, int, int]:
        s = self.spec
        return (s.num_q_heads, s.num_kv_heads, s.head_dim, page_size)

    def _plan_decode(self, wrapper: Any, meta: AttentionMetadata) -> None:
        layout = paged_layout(meta.host.page_table, meta.host.kv_lens, meta.page_size)
        wrapper.plan(*layout, *self._heads(meta.page_size), window_left=self._window_left(),
                     **self._common())

    def graph_capture(self, static: AttentionMetadata) -> None:
        wrapper = None
        if static.is_plain_decode:
            wrapper = self._graphs.get(static.batch_size, int(static.page_table.shape[1]))
            self._plan_decode(wrapper, static)  # the warm-up runs on this (inert) layout
        elif self._torch is None:
            self._torch = TorchAttention(self.spec, self.device)
        self._static[id(static)] = (static, wrapper)

    def graph_replan(self, static: AttentionMetadata, meta: AttentionMetadata) -> None:
        wrapper = self._static[id(static)][1]
        if wrapper is not None:
            self._plan_decode(wrapper, meta)

    def graph_reads_in_place(self, static: AttentionMetadata) -> bool:
        return static.is_plain_decode  # the graph-mode decode wrapper (graph_capture)

    def graph_release(self, static: AttentionMetadata) -> None:
        self._static.pop(id(static), None)

    def _graph_step(self, meta: AttentionMetadata) -> FlashInferStep | None:
        """A graph's static metadata: its step does no host work (see ``graph_capture``)."""
        entry = self._static.get(id(meta))
        if entry is None or entry[0] is not meta:
            return None
        if entry[1] is not None:
            return FlashInferStep(meta, "graph_decode", self._generation, wrapper=entry[1])
        assert self._torch is not None
        return FlashInferStep(meta, "graph_torch", self._generation,
                              inner=self._torch.prepare(meta))

    def prepare(self, meta: AttentionMetadata) -> FlashInferStep:
        graph_step = self._graph_step(meta)
        if graph_step is not None:
            return graph_step
        self._generation += 1
        host = meta.host
        heads = self._heads(meta.page_size)
        q_indptr = torch.from_numpy(host.q_indptr)
        if meta.custom_mask is not None:
            return self._prepare_tree(meta)
        layout = paged_layout(host.page_table, host.kv_lens, meta.page_size)
        if meta.is_plain_decode:
            self._decode.plan(*layout, *heads, window_left=self._window_left(), **self._common())
            return FlashInferStep(meta, "decode", self._generation)
        self._prefill.plan(q_indptr, *layout, *heads, causal=True,
                           window_left=self._window_left(), **self._common())
        return FlashInferStep(meta, "prefill", self._generation)

    def _prepare_tree(self, meta: AttentionMetadata) -> FlashInferStep:
        s, host = self.spec, meta.host
        width = int(meta.custom_mask.shape[2])
        start = host.mask_start.astype(np.int64)
        if not np.array_equal(start + width, host.kv_lens):
            raise NotImplementedError("flashinfer: tree steps need kv_lens == mask_start + M")
        if s.window and s.window <= width:
            raise NotImplementedError("flashinfer: a window no wider than the tree")
        q_indptr = torch.from_numpy(host.q_indptr)
        batch = meta.batch_size
        kv_indptr = torch.arange(batch + 1, dtype=torch.int32) * width
        rows_b = torch.repeat_interleave(torch.arange(batch), torch.from_numpy(np.diff(host.q_indptr)))
        rows_j = torch.arange(len(rows_b)) - q_indptr[:-1].long()[rows_b]
        mask = meta.custom_mask[rows_b.to(self.device), rows_j.to(self.device), :width]
        # The offsets on the mask's device: with a custom mask, plan() derives the packed
        # mask's offsets from them (on their device) for a kernel that takes CUDA tensors
        # only, and it copies them to the host for its own planning anyway.
        self._ragged.plan(q_indptr.to(self.device), kv_indptr.to(self.device), s.num_q_heads,
                          s.num_kv_heads, s.head_dim, custom_mask=mask.reshape(-1),
                          window_left=self._window_left(), **self._common())
        has_prefix = bool(start.max() > 0)
        if has_prefix:
            layout = paged_layout(host.page_table, start.astype(np.int32), meta.page_size)
            self._prefill.plan(q_indptr, *layout, s.num_q_heads, s.num_kv_heads, s.head_dim,
                               meta.page_size, causal=False,
                               window_left=self._window_left(width), **self._common())
        logical = torch.from_numpy(start)[:, None] + torch.arange(width)[None, :]
        pages = torch.from_numpy(host.page_table).long().gather(1, logical // meta.page_size)
        slots = (pages * meta.page_size + logical % meta.page_size).reshape(-1)
        return FlashInferStep(meta, "tree", self._generation, slots.to(self.device), has_prefix)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVPair,
                step: PreparedStep) -> torch.Tensor:
        assert isinstance(step, FlashInferStep)
        if step.kind == "graph_torch":
            assert self._torch is not None and step.inner is not None
            return self._torch.forward(q, k, v, cache, step.inner)
        # A graph step's plan is renewed before each replay (graph_replan), not by prepare().
        if step.generation != self._generation and step.kind != "graph_decode":
            raise RuntimeError("flashinfer: this step's plan was replaced by a later prepare()")
        k_cache, v_cache = cache
        slots = step.meta.write_slots
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        ps, heads, dim = step.meta.page_size, k_cache.shape[1], k_cache.shape[2]
        paged = (k_cache.view(-1, ps, heads, dim), v_cache.view(-1, ps, heads, dim))
        x = q.to(k_cache.dtype).contiguous()  # q sliced from the fused qkv has a row stride
        if step.kind == "decode":
            out = self._decode.run(x, paged)
        elif step.kind == "graph_decode":
            out = step.wrapper.run(x, paged)
        elif step.kind == "prefill":
            out = self._prefill.run(x, paged)
        else:
            out = self._tree(x, k_cache, v_cache, paged, step)
        return out.reshape(q.shape[0], -1).to(q.dtype)

    def _tree(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              paged: tuple[torch.Tensor, torch.Tensor], step: FlashInferStep) -> torch.Tensor:
        assert step.tree_slots is not None
        out, lse = self._ragged.run(q, k_cache[step.tree_slots], v_cache[step.tree_slots],
                                    return_lse=True)
        if not step.has_prefix:
            return out
        prefix, prefix_lse = self._prefill.run(q, paged, return_lse=True)
        merged, _ = self._fi.merge_state(prefix, prefix_lse, out, lse)
        return merged
