"""EAGLE-3 drafting: grow a candidate tree with the draft model, then pick the verified nodes.

Depth 1 comes from the draft's output at the root's predecessor; each later step forwards the
``topk`` best nodes of the previous depth (each paired with its parent's draft hidden state,
as EAGLE feeds the draft its own features) and proposes topk children for each. Only
deterministic ops (log_softmax, topk, stable sort) touch the all-gathered draft logits, so
every rank proposes the same tree without communicating.

Nothing in the loop reads the device back: the batch layout of every depth (slots, key
counts, positions) follows from ``committed`` and the fixed beam width, so it is built before
the loop, and the beam's tokens and ancestor masks stay device tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.models.eagle3 import Eagle3Draft
from tpserve.spec.config import SpecConfig
from tpserve.spec.tree import DraftTree, draft_step_metadata, select_tree, with_inputs

# (batch over B x K beam nodes, beam hidden [B, K, H]) -> (draft out [B*K, H], log-probs)
DraftStep = Callable[[ForwardBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def draft_tree(draft: Eagle3Draft, embed: nn.Module, cache: tuple[torch.Tensor, ...],
               start: torch.Tensor, roots: torch.Tensor, pages: torch.Tensor,
               committed: torch.Tensor, cfg: SpecConfig, page_size: int,
               step_fn: DraftStep | None = None, native: bool = False) -> DraftTree:
    """Propose a tree per request (on ``start``'s device).

    ``start`` [B, H]: the draft's output for the root token (it predicts depth 1);
    ``roots`` [B]: root token ids; ``pages`` [B, P] / ``committed`` [B] (host tensors): page
    table and draft KV entries already committed (temporary nodes go right after them).
    Returns a tree of ``cfg.num_draft_tokens`` nodes. ``step_fn`` runs one draft step (a CUDA
    graph / compiled phase); default: eager. ``native``: the whole loop as one C++ call
    (``can_grow_natively``), bit-equal to the eager loop.
    """
    if native:
        return grow_natively(draft, embed, cache, start, roots, pages, committed, cfg,
                             page_size)
    batch, hidden = start.shape
    k, device = cfg.topk, start.device
    # Every host-to-device copy is queued before the loop, none waits for the device.
    metas = draft_step_metadata(pages.numpy(), committed.numpy().astype("int32"), k,
                                cfg.num_steps, page_size, device)
    base_positions = committed.to(device, non_blocking=True)[:, None].expand(batch, k)
    roots = roots.to(device, non_blocking=True)
    score, ids = torch.log_softmax(draft.logits(start), dim=-1).topk(k, dim=-1)
    tokens = draft.to_target(ids)
    scores, cands, parents = [score], [tokens], [torch.full_like(ids, -1)]
    beam_hidden = start[:, None, :].expand(batch, k, hidden)
    beam_score, beam_tokens = score, tokens
    beam_cand = torch.arange(k, device=device).expand(batch, k)
    ancestors = torch.zeros(batch, k, 0, dtype=torch.bool, device=device)
    eye = torch.eye(k, dtype=torch.bool, device=device).expand(batch, k, k)
    offset = k
    for step, meta in enumerate(metas):
        own = torch.cat([ancestors, eye], dim=2)
        fb = with_inputs(meta, beam_tokens, base_positions + step, own)
        if step_fn is not None:
            out, logp = step_fn(fb, beam_hidden)
        else:
            out = draft(embed(fb.input_ids), beam_hidden.reshape(-1, hidden), fb, cache)
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
        ancestors = own.gather(1, parent_beam[:, :, None].expand(batch, k, own.shape[2]))
        offset += k * k
    return select_tree(roots, torch.cat(scores, 1), torch.cat(cands, 1),
                       torch.cat(parents, 1), cfg.num_draft_tokens, cfg.num_steps)


def can_grow_natively(draft: Eagle3Draft, embed: nn.Module, device: torch.device) -> bool:
    """The native loop applies: the draft's midlayer runs natively (CPU, ``cpu`` attention,
    C++ ops), the draft and its embedding are whole on this rank and nothing is being
    compiled."""
    blocks = draft.blocks
    return (blocks is not None and device.type == "cpu" and not torch.compiler.is_compiling()
            and blocks.can_grow(embed))


def grow_natively(draft: Eagle3Draft, embed: nn.Module, cache: tuple[torch.Tensor, ...],
                  hidden: torch.Tensor, roots: torch.Tensor, pages: torch.Tensor,
                  committed: torch.Tensor, cfg: SpecConfig, page_size: int,
                  extend: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> DraftTree:
    """``draft_tree`` (and with ``extend``, the draft extend before it) as one C++ call."""
    assert draft.blocks is not None
    return DraftTree(*draft.blocks.grow(hidden, roots.to(hidden.device), embed, cache, pages,
                                        committed, cfg.topk, cfg.num_steps,
                                        cfg.num_draft_tokens, page_size, extend))
