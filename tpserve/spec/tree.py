"""Draft trees: choosing the verified nodes from the draft's candidates, and tree masks.

A tree has N nodes per request; node 0 is the root (the last committed token), nodes are
ordered so every parent precedes its children. Everything here is deterministic tensor
arithmetic on data that is identical on every rank, so every rank builds the same tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.plan import Layout, build_forward_batch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [B, N] target token ids; column 0 is the root
    parents: torch.Tensor  # [B, N] parent node index (-1 for the root)
    depths: torch.Tensor  # [B, N] root = 0
    mask: torch.Tensor  # [B, N, N] bool: node i may attend to node j (ancestor or self)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[1])


def select_tree(roots: torch.Tensor, scores: torch.Tensor, tokens: torch.Tensor,
                parents: torch.Tensor, num_nodes: int) -> DraftTree:
    """Keep the ``num_nodes - 1`` best candidates by cumulative log-probability.

    ``scores/tokens/parents`` [B, C]: candidates in proposal order (a parent always has a
    smaller index than its child; parent -1 = root). A child's score is its parent's plus a
    log-probability <= 0, so it never exceeds the parent's; a stable descending sort therefore
    places each parent before its children and any prefix of it is parent-closed.
    """
    batch = roots.shape[0]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : num_nodes - 1]
    chosen = order.sort(dim=1).values  # proposal order: parents precede children
    # Candidate index -> node index (root is node 0; unchosen candidates map to -1).
    node_of = torch.full_like(scores, -1, dtype=torch.long)
    node_of.scatter_(1, chosen, torch.arange(1, num_nodes).expand(batch, -1).contiguous())
    cand_parent = parents.gather(1, chosen)
    node_parent = torch.where(cand_parent < 0, 0, node_of.gather(1, cand_parent.clamp(min=0)))
    if bool((node_parent < 0).any()):
        raise RuntimeError("draft tree selection dropped a parent")
    all_tokens = torch.cat([roots[:, None], tokens.gather(1, chosen)], dim=1)
    all_parents = torch.cat([torch.full((batch, 1), -1), node_parent], dim=1)
    return _finish_tree(all_tokens, all_parents)


def _finish_tree(tokens: torch.Tensor, parents: torch.Tensor) -> DraftTree:
    batch, n = tokens.shape
    mask = torch.eye(n, dtype=torch.bool).expand(batch, n, n).clone()
    depths = torch.zeros(batch, n, dtype=torch.long)
    rows = torch.arange(batch)
    for i in range(1, n):  # parents precede children, so each parent row is already final
        p = parents[:, i]
        mask[:, i] |= mask[rows, p]
        depths[:, i] = depths[rows, p] + 1
    return DraftTree(tokens, parents, depths, mask)


def slots(pages: torch.Tensor, logical: torch.Tensor, page_size: int) -> torch.Tensor:
    page_idx = (logical // page_size).clamp(max=pages.shape[1] - 1)
    return torch.gather(pages, 1, page_idx) * page_size + logical % page_size


def draft_step_batch(tokens: torch.Tensor, pages: torch.Tensor, committed: torch.Tensor,
                     step: int, positions: torch.Tensor, ancestors: torch.Tensor,
                     page_size: int, device: torch.device) -> ForwardBatch:
    """Batch for draft step ``step`` (0-based) over K beam nodes per request.

    Temporary draft nodes live at logical indices committed + s * K + j (s = step they were
    forwarded in); a node sees every committed key and the temporary nodes marked in
    ``ancestors`` [B, K, (step + 1) * K] (its own ancestors and itself).
    """
    batch, k = tokens.shape
    base = (committed + step * k).numpy().astype(np.int32)
    layout = Layout(tokens.reshape(-1).numpy(), np.full(batch, k, dtype=np.int32), base,
                    pages.numpy().astype(np.int32))
    return build_forward_batch(layout, page_size, device,
                               positions=positions.reshape(-1).numpy(),
                               mask_start=committed.numpy().astype(np.int32),
                               custom_mask=ancestors)
