"""Random paged-attention problems and their float64 reference (shared by the backend tests).

A case is one step: a ragged batch of requests with fragmented page tables (a random
permutation of pages, unused table entries pointing at real pages so a kernel that reads past
a request's keys gets wrong numbers), optionally a shared prefix (two requests' tables point at
the same pages), a sliding window and a speculative mask (a verify tree or a draft step's
ancestor mask). The reference writes the new keys itself (slots from the page table, not from
the metadata) and attends per request in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tpserve.layers.attention import AttentionMetadata, AttentionSpec, build_metadata

CPU = torch.device("cpu")


@dataclass
class Case:
    q: torch.Tensor  # [N, Hq, D]
    k: torch.Tensor  # [N, Hk, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [S, Hk, D]
    v_cache: torch.Tensor
    page_table: np.ndarray  # [B, P] int32
    q_lens: np.ndarray
    kv_lens: np.ndarray
    page_size: int
    spec: AttentionSpec
    mask_start: np.ndarray | None = None
    custom_mask: torch.Tensor | None = None  # [B, Qmax, M] bool

    def metadata(self, device: torch.device = CPU) -> AttentionMetadata:
        return build_metadata(self.page_table, self.q_lens, self.kv_lens, self.page_size, device,
                              self.mask_start, self.custom_mask)

    def caches(self, device: torch.device = CPU) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone().to(device), self.v_cache.clone().to(device)


def tree_mask(batch: int, nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[B, N, N] ancestor-or-self masks of random trees whose parents precede their children."""
    mask = torch.eye(nodes, dtype=torch.bool).repeat(batch, 1, 1)
    for b in range(batch):
        for i in range(1, nodes):
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[b, i] |= mask[b, parent]
    return mask


def draft_mask(batch: int, beam: int, step: int, gen: torch.Generator) -> torch.Tensor:
    """[B, K, (step + 1) K]: each beam node sees its ancestors in earlier steps and itself."""
    own = torch.eye(beam, dtype=torch.bool).repeat(batch, 1, 1)
    for _ in range(step):
        parents = torch.randint(0, beam, (batch, beam), generator=gen)
        ancestors = own.gather(1, parents[:, :, None].expand(-1, -1, own.shape[2]))
        own = torch.cat([ancestors, torch.eye(beam, dtype=torch.bool).repeat(batch, 1, 1)], 2)
    return own


def _page_tables(kv_lens: np.ndarray, old: np.ndarray, page_size: int, share: bool,
                 rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Tables covering ``kv_lens`` keys; with ``share``, requests 0 and 1 share the pages that
    hold only keys older than this step (``old`` per request), as a prefix cache would."""
    need = -(-kv_lens // page_size)
    width = int(need.max()) + 2
    shared = 0
    if share and len(kv_lens) >= 2:
        shared = int(min(old[0], old[1]) // page_size)
    total = int(need.sum()) - shared + 1
    order = rng.permutation(np.arange(1, total)).astype(np.int32)
    table = rng.integers(1, total, size=(len(kv_lens), width), dtype=np.int32)
    used = 0
    for b, n in enumerate(need):
        if b == 1 and shared:
            table[1, :shared] = table[0, :shared]
            table[1, shared:n] = order[used:used + n - shared]
            used += int(n) - shared
        else:
            table[b, :n] = order[used:used + n]
            used += int(n)
    return table, total


def make_case(seed: int, q_lens: list[int], cached: list[int], heads: tuple[int, int],
              head_dim: int, dtype: torch.dtype = torch.float32, page_size: int = 16,
              window: int | None = None, mask: str | None = None, share: bool = False,
              draft_step: int = 0) -> Case:
    """``q_lens`` new tokens after ``cached`` ones per request. ``mask``: None (causal),
    "tree" (a verify tree over the q_len new tokens) or "draft" (step ``draft_step`` of K =
    q_len beam nodes: the new tokens follow ``draft_step * K`` earlier temporary nodes, which
    ``cached`` does not count)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    q = np.array(q_lens, dtype=np.int32)
    committed = np.array(cached, dtype=np.int32)
    earlier = draft_step * q if mask == "draft" else 0
    kv = committed + earlier + q
    table, num_pages = _page_tables(kv, kv - q, page_size, share, rng)
    hq, hk = heads
    rows = int(q.sum())

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    start, custom = None, None
    if mask == "tree":
        start, custom = committed, tree_mask(len(q), int(q.max()), gen)
    elif mask == "draft":
        start, custom = committed, draft_mask(len(q), int(q.max()), draft_step, gen)
    spec = AttentionSpec(hq, hk, head_dim, head_dim ** -0.5, dtype, window)
    return Case(rand(rows, hq, head_dim), rand(rows, hk, head_dim), rand(rows, hk, head_dim),
                rand(num_pages * page_size, hk, head_dim), rand(num_pages * page_size, hk, head_dim),
                table, q, kv, page_size, spec, start, custom)


def _visible(case: Case, b: int) -> torch.Tensor:
    kv, ql = int(case.kv_lens[b]), int(case.q_lens[b])
    t = torch.arange(kv)[None, :]
    at = (kv - ql + torch.arange(ql))[:, None]
    if case.custom_mask is None:
        vis = t <= at
    else:
        start, width = int(case.mask_start[b]), case.custom_mask.shape[2]
        vis = (t < start).expand(ql, kv).clone()
        for j in range(ql):
            for key in range(start, min(start + width, kv)):
                vis[j, key] = bool(case.custom_mask[b, j, key - start])
    if case.spec.window:
        vis &= t > at - case.spec.window
    return vis


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [N, Hq * D] float64, k_cache, v_cache after the write)."""
    kc, vc = case.caches()
    ps, group = case.page_size, case.spec.num_q_heads // case.spec.num_kv_heads
    outs, row = [], 0
    for b in range(len(case.q_lens)):
        kv, ql = int(case.kv_lens[b]), int(case.q_lens[b])
        t = torch.arange(kv)
        slots = torch.from_numpy(case.page_table[b]).long()[t // ps] * ps + t % ps
        kc[slots[kv - ql:]] = case.k[row:row + ql].to(kc.dtype)
        vc[slots[kv - ql:]] = case.v[row:row + ql].to(vc.dtype)
        keys = kc[slots].double().repeat_interleave(group, 1)  # [T, Hq, D]
        values = vc[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,thd->hqt", case.q[row:row + ql].double(), keys)
        scores = (scores * case.spec.scale).masked_fill(~_visible(case, b), float("-inf"))
        probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row that sees nothing: zeros
        outs.append(torch.einsum("hqt,thd->qhd", probs, values).reshape(ql, -1))
        row += ql
    return torch.cat(outs), kc, vc
