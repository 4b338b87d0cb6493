"""EAGLE-3 drafting: grow a candidate tree with the draft model, then pick the verified nodes.

Depth 1 comes from the draft's output at the root's predecessor; each later step forwards the
``topk`` best nodes of the previous depth (each paired with its parent's draft hidden state,
as EAGLE feeds the draft its own features) and proposes topk children for each. Only
deterministic ops (log_softmax, topk, stable sort) touch the all-gathered draft logits, so
every rank proposes the same tree without communicating.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.models.eagle3 import Eagle3Draft
from tpserve.spec.config import SpecConfig
from tpserve.spec.tree import DraftTree, draft_step_batch, select_tree

# (batch over B x K beam nodes, beam hidden [B, K, H]) -> (draft out [B*K, H], log-probs)
DraftStep = Callable[[ForwardBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def draft_tree(draft: Eagle3Draft, embed: nn.Module, cache: tuple[torch.Tensor, torch.Tensor],
               start: torch.Tensor, roots: torch.Tensor, pages: torch.Tensor,
               committed: torch.Tensor, cfg: SpecConfig, page_size: int,
               step_fn: DraftStep | None = None) -> DraftTree:
    """Propose a tree per request.

    ``start`` [B, H]: the draft's output for the root token (it predicts depth 1);
    ``roots`` [B]: root token ids; ``committed`` [B]: draft KV entries already committed
    (temporary nodes go right after them). Returns a tree of ``cfg.num_draft_tokens`` nodes.
    ``step_fn`` runs one draft step (a CUDA graph / compiled phase); default: eager.
    """
    batch, hidden = start.shape
    k, device = cfg.topk, start.device
    score, ids = torch.log_softmax(draft.logits(start), dim=-1).topk(k, dim=-1)
    tokens = draft.to_target(ids)
    scores, cands, parents = [score], [tokens], [torch.full_like(ids, -1)]
    beam_hidden = start[:, None, :].expand(batch, k, hidden)
    beam_score, beam_tokens = score, tokens
    beam_cand = torch.arange(k, device=device).expand(batch, k)
    ancestors = torch.zeros(batch, k, 0, dtype=torch.bool)
    offset = k
    for step in range(cfg.num_steps - 1):
        own = torch.cat([ancestors, torch.eye(k, dtype=torch.bool).expand(batch, k, k)], dim=2)
        positions = (committed + step)[:, None].expand(batch, k)
        fb = draft_step_batch(beam_tokens.cpu(), pages, committed, step, positions, own,
                              page_size, device)
        if step_fn is not None:
            out, logp = step_fn(fb, beam_hidden)
        else:
            out = draft(embed(beam_tokens.reshape(-1)), beam_hidden.reshape(-1, hidden), fb,
                        cache)
            logp = torch.log_softmax(draft.logits(out), dim=-1)
        logp = logp.view(batch, k, -1)
        top_score, top_ids = logp.topk(k, dim=-1)  # [B, K(parent beam), K(child)]
        child_score = (beam_score[:, :, None] + top_score).reshape(batch, k * k)
        child_tokens = draft.to_target(top_ids).reshape(batch, k * k)
        scores.append(child_score)
        cands.append(child_tokens)
        parents.append(beam_cand[:, :, None].expand(batch, k, k).reshape(batch, k * k))
        beam_score, pick = child_score.topk(k, dim=-1)
        parent_beam = pick // k
        beam_tokens = child_tokens.gather(1, pick)
        beam_cand = offset + pick
        beam_hidden = out.view(batch, k, hidden).gather(
            1, parent_beam[:, :, None].expand(batch, k, hidden))
        ancestors = own.gather(1, parent_beam.cpu()[:, :, None].expand(batch, k, own.shape[2]))
        offset += k * k
    return select_tree(roots.cpu(), torch.cat(scores, 1).cpu(), torch.cat(cands, 1).cpu(),
                       torch.cat(parents, 1).cpu(), cfg.num_draft_tokens)
