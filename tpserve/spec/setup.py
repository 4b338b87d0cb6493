"""Building the speculative decoder on a rank: the draft model first, then its KV cache.

The draft's weights, and the copy of the target's embedding it may need, are made before
the KV cache is sized (so a GPU's free memory already accounts for them), and its KV shares
the target's pages, so the builder sizes the page pool for both layouts together
(``LoadedDraft.kv_layout``).

``--speculative-draft-tp 1`` (the default) gives every rank the whole draft and a whole copy
of the target's embedding table: every rank then drafts the same tree from the same inputs
with no collective at all. A draft is a single small layer, so at TP > 1 the dozen allreduces
of a sharded draft step cost far more than the duplicated arithmetic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from comm_backends.base import gather_rows
from tpserve.engine.kv_cache import KVCacheConfig, KVLayout, backed_kv
from tpserve.engine.runner import ModelRunner
from tpserve.errors import ConfigError
from tpserve.layers.tp import TPContext
from tpserve.layers.vocab import VocabParallelEmbedding
from tpserve.models.config import ModelConfig, ModelConfigError
from tpserve.models.eagle3 import (
    Eagle3Draft,
    aux_layer_indices,
    build_eagle3,
    load_eagle3_config,
)
from tpserve.spec.config import SpecConfig, check_draft_matches
from tpserve.spec.decoder import SpecDecoder
from tpserve.spec.drafter import Drafter

log = logging.getLogger(__name__)
FLAG = "--speculative-draft-model-path"


@dataclass
class LoadedDraft:
    model: Eagle3Draft
    aux_layers: tuple[int, ...]
    kv_layout: KVLayout  # per token, on this rank (one layer)
    embed: nn.Module  # the target's embedding table as the draft reads it (draft_embedding)


def draft_tp_context(draft_tp: int, tp: TPContext) -> TPContext:
    """The draft's TP context: replicated (1) or sharded like the target (the TP size)."""
    if draft_tp == 1:
        return TPContext.single()
    if draft_tp == tp.size:
        return tp
    raise ConfigError(f"--speculative-draft-tp must be 1 or the TP size ({tp.size}), "
                      f"got {draft_tp}", "--speculative-draft-tp")


def load_draft(cfg: SpecConfig, draft_path: str, target: ModelConfig, tp: TPContext,
               dtype: torch.dtype, device: torch.device, max_position: int,
               headroom: int, target_embed: VocabParallelEmbedding) -> LoadedDraft:
    """Load the EAGLE-3 draft for ``target``; problems raise ConfigError.

    ``tp``: the draft's own context (``draft_tp_context``).
    ``headroom``: positions the rotary tables reach past the context (tree nodes sit there).
    ``target_embed``: the target's embedding; the draft's view of it is made here, with the
    draft's weights (on a GPU rank at TP > 1 a gathered copy of the whole table, which must
    exist before the KV cache is sized from the free memory).
    """
    if cfg.num_steps + 1 >= headroom:
        raise ConfigError(f"--speculative-num-steps must be below {headroom - 1}",
                          "--speculative-num-steps")
    try:
        draft_cfg = load_eagle3_config(draft_path)
    except (ModelConfigError, OSError, ValueError) as exc:
        raise ConfigError(f"cannot read draft model: {exc}", FLAG) from None
    check_draft_matches(draft_cfg, target)
    aux = aux_layer_indices(draft_cfg, target.num_layers)
    try:
        draft = build_eagle3(draft_path, draft_cfg, tp, dtype, device, max_position)
    except ValueError as exc:  # shape mismatches, missing tensors
        raise ConfigError(f"cannot load draft model '{draft_path}': {exc}", FLAG) from None
    layout = KVLayout.gqa(1, draft.self_attn.kv_heads, draft_cfg.base.head_dim)
    log.info("EAGLE-3 draft: aux layer inputs %s, steps %d, topk %d, %d draft tokens",
             aux, cfg.num_steps, cfg.topk, cfg.num_draft_tokens)
    return LoadedDraft(draft, aux, layout, draft_embedding(target_embed, tp))


def make_decoder(loaded: LoadedDraft, cfg: SpecConfig, runner: ModelRunner, tp: TPContext,
                 draft_ranks: str = "auto") -> SpecDecoder:
    """The decoder over ``runner``'s target, its draft KV on the same pages as the target's.
    ``tp``: the target's context; ``draft_ranks``: ``--speculative-draft-ranks``."""
    kv = runner.kv.cfg
    draft_kv = backed_kv(KVCacheConfig(kv.num_pages, kv.page_size, loaded.kv_layout, kv.dtype),
                         runner.device, runner.kv.prefault)
    drafting = drafting_rank(draft_ranks, tp.size, loaded.model.tp.size, runner.device,
                             runner.model.cfg.vocab_size)
    return SpecDecoder(Drafter(runner, loaded.model, draft_kv, cfg, loaded.aux_layers,
                               loaded.embed,
                               drafting, tp.rank, tp.size))


DRAFT_RANKS = ("auto", "all", "one")
RANKS_FLAG = "--speculative-draft-ranks"


def drafting_rank(mode: str, world: int, draft_tp: int, device: torch.device,
                  vocab: int) -> int | None:
    """The one rank that drafts (the last), or None where every rank drafts the same tree.

    ``one`` needs a replicated draft at TP > 1 and token ids exact in fp32 (the tree travels
    as fp32); ``auto`` picks it on CPU, where the ranks share the cores and rank 0 has host
    work to overlap with the draft. On GPUs the host work already overlaps the device's, so
    ``auto`` keeps every rank drafting (no extra collective)."""
    mode = mode.lower()
    if mode not in DRAFT_RANKS:
        raise ConfigError(f"{RANKS_FLAG} must be one of {', '.join(DRAFT_RANKS)}, got '{mode}'",
                          RANKS_FLAG)
    possible = world > 1 and draft_tp == 1 and vocab < 2**24
    if mode == "one" and not possible:
        raise ConfigError(f"{RANKS_FLAG} one needs TP > 1 with --speculative-draft-tp 1 "
                          f"(TP {world}, draft TP {draft_tp})", RANKS_FLAG)
    if mode == "all" or not possible or mode == "auto" and device.type != "cpu":
        return None
    return world - 1


def draft_embedding(target: VocabParallelEmbedding, draft_tp: TPContext) -> nn.Module:
    """The embedding the draft reads: the target's own when the draft is sharded like it,
    else the whole table: the one a CPU rank already keeps (``VocabParallelEmbedding.table``,
    the same on every rank, so no rank gathers), or a copy gathered once from every rank's
    vocab slice (no collective per step)."""
    if draft_tp.size == target.tp.size:
        return target
    shard = target.weight.detach()
    if target.table is not None:
        whole = VocabParallelEmbedding(target.vocab, shard.shape[1], draft_tp, shard.dtype,
                                       torch.device("meta"))
        whole.weight = nn.Parameter(target.table, requires_grad=False)
        return whole.eval()
    # Gathered straight into the table (the padded rows of the last shard stay past the
    # view's end): one table's memory at the peak, not the pieces, their concatenation and
    # a copy (3x; a 129K x 7168 bf16 table is 1.8 GB).
    rows = gather_rows(shard, target.tp.size, None)
    full = VocabParallelEmbedding(target.vocab, shard.shape[1], draft_tp, shard.dtype,
                                  torch.device("meta"))
    full.weight = nn.Parameter(rows[: target.vocab], requires_grad=False)
    return full.eval()
