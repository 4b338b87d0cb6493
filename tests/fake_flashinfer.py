"""A CPU stand-in for the parts of ``flashinfer`` the backend calls, from FlashInfer's documented
semantics, so the backend's glue (page layout, query alignment, window offsets, tree masks,
log-sum-exp merge) is tested where no GPU is. The GPU tests check the real library.

Semantics modelled: NHD paged caches [pages, page_size, Hk, D]; a request's keys are its pages
in indptr order, the last one filled to last_page_len; query i of a request with qo_len queries
and kv_len keys sits at position kv_len - qo_len + i; causal hides keys after it, window_left
w >= 0 hides keys before position - w; a custom mask is each request's [qo_len, kv_len] block,
row-major, concatenated; lse is base 2.

CUDA-graph mode (``BatchDecodeWithPagedKVCacheWrapper(..., use_cuda_graph=True, paged_kv_*_buffer=...)``):
the batch size is fixed at construction (the last-page-length buffer's length, the indptr
buffer one longer), ``plan`` refuses another batch size or more page indices than the indices
buffer holds and copies the layout into the caller's buffers, and ``run`` reads the layout from
those buffers when it runs, as a captured kernel does at each replay; nothing it learnt at an
earlier ``plan`` is used.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Q, Hq, D], keys/values [T, Hk, D], visible [Q, T] -> out [Q, Hq, D], lse2 [Q, Hq]."""
    group = q.shape[1] // max(keys.shape[1], 1)
    k = keys.float().repeat_interleave(group, 1)
    v = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,thd->qht", q.float(), k) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)  # -inf where nothing is visible
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("qht,thd->qhd", probs, v).to(q.dtype), lse / math.log(2)


class _Wrapper:
    def __init__(self, workspace: torch.Tensor, layout: str = "NHD", **_: Any) -> None:
        assert layout == "NHD"
        self.plan_args: dict[str, Any] = {}

    def _visible(self, b: int, qo_len: int, kv_len: int, mask_at: int) -> torch.Tensor:
        a = self.plan_args
        pos = kv_len - qo_len + torch.arange(qo_len)[:, None]
        t = torch.arange(kv_len)[None, :]
        vis = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if a.get("custom_mask") is not None:
            vis = a["custom_mask"][mask_at:mask_at + qo_len * kv_len].view(qo_len, kv_len).cpu()
        elif a.get("causal", False):
            vis = t <= pos
        if a.get("window_left", -1) >= 0:
            vis = vis & (t >= pos - a["window_left"])
        return vis

    def _run(self, q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
             qo_indptr: list[int], return_lse: bool) -> Any:
        outs, lses, mask_at = [], [], 0
        for b, (keys, values) in enumerate(kv):
            rows = q[qo_indptr[b]:qo_indptr[b + 1]]
            vis = self._visible(b, rows.shape[0], keys.shape[0], mask_at)
            mask_at += rows.shape[0] * keys.shape[0]
            out, lse = _attend(rows, keys, values, vis, self.plan_args["sm_scale"])
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs), torch.cat(lses)
        return (out, lse) if return_lse else out


class _Paged(_Wrapper):
    def _plan_paged(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
                    page_size: int, **kwargs: Any) -> None:
        self.plan_args = dict(indptr=indptr.tolist(), indices=indices.tolist(),
                              last=last.tolist(), page_size=page_size, **kwargs)

    def _keys(self, cache: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        a, out = self.plan_args, []
        for b in range(len(a["indptr"]) - 1):
            pages = a["indices"][a["indptr"][b]:a["indptr"][b + 1]]
            n = (len(pages) - 1) * a["page_size"] + a["last"][b] if pages else 0
            out.append(tuple(c[pages].reshape(-1, *c.shape[2:])[:n] for c in cache))
        return out


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, workspace: torch.Tensor, layout: str = "NHD", use_cuda_graph: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, **kw: Any) -> None:
        super().__init__(workspace, layout, **kw)
        self.buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.fixed_batch = 0
        if use_cuda_graph:
            bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            if not all(isinstance(b, torch.Tensor) for b in bufs):
                raise ValueError("cudagraph mode needs the three paged_kv_*_buffer tensors")
            self.buffers = bufs  # type: ignore[assignment]
            self.fixed_batch = len(bufs[2])
            if len(bufs[0]) != self.fixed_batch + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             **kwargs: Any) -> None:
        if self.buffers is None:
            self._plan_paged(indptr, indices, last, page_size, **kwargs)
            return
        if len(last) != self.fixed_batch:
            raise ValueError(f"The batch size should be fixed in cudagraph mode: {len(last)} "
                             f"!= {self.fixed_batch}")
        if len(indices) > len(self.buffers[1]):
            raise ValueError("The size of indices should be less than or equal to the buffer")
        self.buffers[0].copy_(indptr)
        self.buffers[1][:len(indices)].copy_(indices)
        self.buffers[2].copy_(last)
        self.plan_args = dict(page_size=page_size, **kwargs)  # no layout: run reads the buffers

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
            return_lse: bool = False) -> Any:
        if self.buffers is not None:
            assert q.shape[0] == self.fixed_batch, "a graph wrapper runs its own batch size"
            indptr, indices, last = (b.tolist() for b in self.buffers)
            self.plan_args.update(indptr=indptr, indices=indices[:indptr[-1]], last=last)
        return self._run(q, self._keys(cache), list(range(q.shape[0] + 1)), return_lse)


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
             last: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, **kwargs: Any) -> None:
        self._plan_paged(indptr, indices, last, page_size, qo_indptr=qo_indptr.tolist(),
                         **kwargs)

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
            return_lse: bool = False) -> Any:
        return self._run(q, self._keys(cache), self.plan_args["qo_indptr"], return_lse)


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, **kwargs: Any) -> None:
        self.plan_args = dict(qo_indptr=qo_indptr.tolist(), kv_indptr=kv_indptr.tolist(),
                              **kwargs)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            return_lse: bool = False) -> Any:
        ptr = self.plan_args["kv_indptr"]
        kv = [(k[ptr[b]:ptr[b + 1]], v[ptr[b]:ptr[b + 1]]) for b in range(len(ptr) - 1)]
        return self._run(q, kv, self.plan_args["qo_indptr"], return_lse)


class BatchMLAPagedAttentionWrapper:
    """``flashinfer.mla``'s paged MLA wrapper: caches ckv [pages, page_size, C] and kpe [pages,
    page_size, R] (strided views allowed), kv_indices pages in kv_indptr order, kv_len_arr each
    request's key count; scores q_nope . ckv + q_pe . kpe times sm_scale, output the weighted
    ckv. In CUDA-graph mode the four buffers are the caller's, the batch size is fixed, and
    ``run`` reads the layout from them, as a replayed kernel does."""

    def __init__(self, workspace: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        self.buffers: tuple[torch.Tensor, ...] | None = None
        if use_cuda_graph:
            bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
            if not all(isinstance(b, torch.Tensor) for b in bufs):
                raise ValueError("cudagraph mode needs the four buffers")
            if not len(bufs[0]) == len(bufs[1]) == len(bufs[3]) + 1:  # type: ignore[arg-type]
                raise ValueError("indptr buffers must be one longer than kv_len_arr")
            self.buffers = bufs  # type: ignore[assignment]
        self.layout: tuple[list[int], ...] = ()
        self.args: dict[str, Any] = {}

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type: torch.dtype, use_profiler: bool = False) -> None:
        self.args = dict(heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe,
                         page_size=page_size, causal=causal, sm_scale=sm_scale)
        layout = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        if self.buffers is None:
            self.layout = tuple(t.tolist() for t in layout)
            return
        if len(kv_len_arr) != len(self.buffers[3]):
            raise ValueError("The batch size should be fixed in cudagraph mode")
        if len(kv_indices) > len(self.buffers[2]):
            raise ValueError("The size of indices should be less than or equal to the buffer")
        for i, (buf, src) in enumerate(zip(self.buffers, layout, strict=True)):
            if i != 2 and len(src) != len(buf):  # whole-buffer copies, as the library makes
                raise ValueError("qo_indptr, kv_indptr and kv_len_arr must fill their buffers")
            buf[:len(src)].copy_(src)
        self._plan_info = [len(kv_len_arr), num_heads]  # fixed for a batch, as the library's

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, return_lse: bool = False) -> torch.Tensor:
        a = self.args
        assert ckv_cache.shape[1:] == (a["page_size"], a["ckv"])
        assert kpe_cache.shape[1:] == (a["page_size"], a["kpe"])
        assert q_nope.shape[1] == a["heads"] and q_pe.shape[1] == a["heads"]
        qo, indptr, indices, kv_len = (self.layout if self.buffers is None
                                       else tuple(b.tolist() for b in self.buffers))
        outs = []
        for b in range(len(kv_len)):
            pages, n = indices[indptr[b]:indptr[b + 1]], kv_len[b]
            ckv = ckv_cache[pages].reshape(-1, a["ckv"])[:n].float()
            kpe = kpe_cache[pages].reshape(-1, a["kpe"])[:n].float()
            rows = slice(qo[b], qo[b + 1])
            scores = (torch.einsum("qhc,tc->qht", q_nope[rows].float(), ckv)
                      + torch.einsum("qhr,tr->qht", q_pe[rows].float(), kpe)) * a["sm_scale"]
            if a["causal"]:
                pos = n - (qo[b + 1] - qo[b]) + torch.arange(qo[b + 1] - qo[b])[:, None, None]
                scores = scores.masked_fill(torch.arange(n)[None, None, :] > pos, float("-inf"))
            outs.append(torch.einsum("qht,tc->qhc", torch.softmax(scores, -1), ckv))
        return torch.cat(outs).to(q_nope.dtype)


def merge_state(va: torch.Tensor, sa: torch.Tensor, vb: torch.Tensor,
                sb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    top = torch.maximum(sa, sb)
    wa, wb = torch.exp2(sa - top).nan_to_num(0.0), torch.exp2(sb - top).nan_to_num(0.0)
    total = wa + wb
    v = (va.float() * wa[..., None] + vb.float() * wb[..., None]) / total[..., None]
    return v.to(va.dtype), top + torch.log2(total)


def module() -> SimpleNamespace:
    return SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
        merge_state=merge_state,
        mla=SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper))
