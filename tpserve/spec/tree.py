"""Draft trees: choosing the verified nodes from the draft's candidates, and tree batches.

A tree has N nodes per request; node 0 is the root (the last committed token), nodes are
ordered so every parent precedes its children. Everything here is deterministic tensor
arithmetic on data that is identical on every rank, so every rank builds the same tree, and
it runs on the tensors' device without reading them back: the host learns the tree only when
rank 0 accepts (one copy for the whole batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.layers.attention.metadata import AttentionMetadata, build_metadata


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
                parents: torch.Tensor, num_nodes: int, max_depth: int | None = None
                ) -> DraftTree:
    """Keep the ``num_nodes - 1`` best candidates by cumulative log-probability.

    ``scores/tokens/parents`` [B, C]: candidates in proposal order (a parent always has a
    smaller index than its child; parent -1 = root). A child's score is its parent's plus a
    log-probability <= 0, so it never exceeds the parent's; a stable descending sort therefore
    places each parent before its children and any prefix of it is parent-closed.
    ``max_depth`` bounds the tree's depth (the draft steps; default: the node count).
    """
    batch, device = roots.shape[0], roots.device
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : num_nodes - 1]
    chosen = order.sort(dim=1).values  # proposal order: parents precede children
    # Candidate index -> node index (root is node 0; unchosen candidates map to -1).
    node_of = torch.full_like(scores, -1, dtype=torch.long)
    node_of.scatter_(1, chosen,
                     torch.arange(1, num_nodes, device=device).expand(batch, -1).contiguous())
    cand_parent = parents.gather(1, chosen)
    # The clamp never changes a parent-closed selection (see above); it only keeps a NaN-scored
    # draft from indexing out of range, which would still verify losslessly (as a root child).
    node_parent = torch.where(cand_parent < 0, 0,
                              node_of.gather(1, cand_parent.clamp(min=0))).clamp(min=0)
    all_tokens = torch.cat([roots[:, None], tokens.gather(1, chosen)], dim=1)
    all_parents = torch.cat([torch.full((batch, 1), -1, device=device), node_parent], dim=1)
    return _finish_tree(all_tokens, all_parents, num_nodes - 1 if max_depth is None
                        else max_depth)


def _finish_tree(tokens: torch.Tensor, parents: torch.Tensor, max_depth: int) -> DraftTree:
    """Ancestor masks by walking every node's chain one level per iteration (``max_depth``
    vectorised steps instead of a loop over nodes)."""
    batch, n = tokens.shape
    mask = torch.eye(n, dtype=torch.bool, device=tokens.device).expand(batch, n, n).clone()
    node = parents
    for _ in range(max_depth):
        # A finished chain (node -1) marks column 0: the root is every node's ancestor anyway.
        mask.scatter_(2, node.clamp(min=0)[:, :, None], True)
        node = torch.where(node >= 0, parents.gather(1, node.clamp(min=0)), -1)
    depths = mask.sum(dim=2) - 1
    return DraftTree(tokens, parents, depths, mask)


def tree_metadata(pages: np.ndarray, cached: np.ndarray, queries: int, mask_start: np.ndarray,
                  mask_width: int, page_size: int, device: torch.device,
                  chain: bool = False) -> AttentionMetadata:
    """Metadata of a batch of ``queries`` speculative rows per request written after
    ``cached`` [B] entries, whose mask [B, queries, mask_width] comes later (``with_inputs``).
    ``chain``: the verify of a topk-1 tree, whose mask is causal by construction (every
    candidate is chosen, each the child of the one before: ``select_tree``).

    Everything here is host data known before drafting starts, so building it up front keeps
    host-to-device copies (which can wait for the device) out of the draft loop.
    """
    batch = len(cached)
    placeholder = torch.empty(batch, queries, mask_width, dtype=torch.bool, device=device)
    q_lens = np.full(batch, queries, dtype=np.int32)
    return build_metadata(pages, q_lens, cached + queries, page_size, device,
                          mask_start=mask_start, custom_mask=placeholder, mask_is_causal=chain)


def with_inputs(meta: AttentionMetadata, tokens: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> ForwardBatch:
    """The forward batch of ``meta`` fed ``tokens``/``positions`` [B, Q] and ``mask``
    [B, Q, M], all on the device."""
    attn = dataclasses.replace(meta, custom_mask=mask.contiguous())
    return ForwardBatch(tokens.reshape(-1), positions.reshape(-1), attn, int(tokens.shape[1]))


def draft_step_metadata(pages: np.ndarray, committed: np.ndarray, topk: int, num_steps: int,
                        page_size: int, device: torch.device) -> list[AttentionMetadata]:
    """Metadata of draft steps 0 .. num_steps - 2 over K beam nodes per request.

    Temporary draft nodes live at logical indices committed + s * K + j (s = step they were
    forwarded in); a node sees every committed key and the temporary nodes its mask
    [B, K, (s + 1) * K] marks (its own ancestors and itself).
    """
    return [tree_metadata(pages, committed + s * topk, topk, committed, (s + 1) * topk,
                          page_size, device) for s in range(num_steps - 1)]
