"""The tensor work of EAGLE-3 speculation, done identically on every rank.

State kept per request (keyed by an integer rank 0 assigns): the draft features (``fc`` of
the target's aux states) for the last tokens whose draft KV is not yet written. The draft row
for token t pairs embed(token t) with the feature of position t - 1 and is stored at draft KV
index t - 1, so the draft KV shares the request's page table.

One speculative step over a decode batch, with L = seq_len and the root = token L - 1:
1. draft extend over the pending tokens (writes committed draft KV, ends at the root's row);
2. drafting: a tree of N nodes (identical on every rank, no communication);
3. verify: one target forward over the tree (tree mask, depth positions) with aux states;
4. after rank 0 has chosen the accepted paths: move the accepted nodes' target KV to
   consecutive slots and keep the path's features as the new pending rows (their draft KV
   is written by the next step's extend).

With one drafting rank that is not rank 0, a greedy step lets that rank run ahead: it works
out the accepted paths and the next plan from the verify logits it holds too, and grows the
next tree while rank 0 is still accepting, streaming and planning (``run_ahead``); the real
messages then only confirm it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import numpy as np
import torch

from tpserve.engine.buckets import round_up
from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.kv_cache import KVCache
from tpserve.engine.messages import DraftFeed, ForwardStep, SpecCommit, SpecStep
from tpserve.engine.plan import Layout, build_forward_batch, plan_fingerprint, same_array
from tpserve.engine.runner import ForwardOutput, ModelRunner
from tpserve.engine.static_forward import draft_forward, run_static, verify_forward
from tpserve.layers.attention.metadata import AttentionMetadata
from tpserve.models.eagle3 import Eagle3Draft
from tpserve.spec.config import SpecConfig
from tpserve.spec.eagle import can_grow_natively, draft_tree, grow_natively
from tpserve.spec.tree import DraftTree, tree_metadata, with_inputs
from tpserve.spec.verify import Accepted, greedy_paths

# Enters a named part of the step: tags its allreduces (and times it on rank 0).
PhaseScope = Callable[[str], AbstractContextManager[None]]


@dataclass
class Verified:
    tree: DraftTree
    logits: torch.Tensor  # [B, N, V]
    features: torch.Tensor  # [B, N, H] fc'd target features of every node
    pages: np.ndarray  # [B, P] the plan's page table
    committed: np.ndarray  # [B] target KV length before the step (= L - 1)


@dataclass(frozen=True)
class Ahead:
    """A tree the drafting follower grew before rank 0's commit and plan arrived."""

    step: SpecStep  # the plan it assumed
    paths: list[list[int]]  # the commit it assumed
    pages: np.ndarray  # [B] leading page-table entries of each request its draft read or wrote
    tree: DraftTree
    verify_meta: AttentionMetadata | None  # the assumed plan's verify layout (if it has one)
    verify_pages: np.ndarray  # [B] leading page-table entries that layout reads or writes

    def fits(self, step: SpecStep) -> bool:
        """Whether ``step`` is the assumed plan, as far as the draft is concerned: the same
        requests, pending tokens and lengths, and the same pages wherever the draft went
        (a page the real plan added beyond them does not matter; dropped keys neither)."""
        return (same_requests(step, self.step)
                and same_leading_pages(step.page_table, self.step.page_table, self.pages))

    def layout_fits(self, step: SpecStep) -> bool:
        """Whether the verify layout applies to ``step`` (which ``fits``): the same pages
        wherever the verify goes. A page the real plan added beyond them (the scheduler
        keeps the next steps' slots ahead) is never read by this verify."""
        return (self.verify_meta is not None
                and same_leading_pages(step.page_table, self.step.page_table,
                                       self.verify_pages))


@dataclass(frozen=True)
class Guess:
    """The commit and next plan a greedy speculative step leads to when no request
    finishes, joins or leaves: the same requests, each extended by its accepted tokens, on
    the pages it holds (the real plan may add pages)."""

    step: SpecStep
    paths: list[list[int]]
    lens: list[int]  # each request's sequence length after the commit
    held: list[int]  # pages each request holds in the plan (``held_pages``)
    reach: list[int]  # leading pages of each request the next tree reads or writes

    def fingerprint(self) -> int:
        return plan_fingerprint(self.step)

    def is_plan(self, step: SpecStep) -> bool:
        """``step`` is the guessed plan, field by field, but for its page table
        (``same_pages`` says whether that too is the guess's)."""
        guess = self.step
        return (step.greedy == guess.greedy and same_requests(step, guess)
                and same_array(step.drop, guess.drop))

    def same_pages(self, step: SpecStep) -> bool:
        return same_array(step.page_table, self.step.page_table)


def held_pages(page_table: np.ndarray) -> list[int]:
    """[B] pages each request holds: its row's leading nonzero entries (page 0 is the dummy
    page that pads shorter rows)."""
    return np.count_nonzero(page_table, axis=1).tolist()


def same_leading_pages(real: np.ndarray, guess: np.ndarray, counts: np.ndarray) -> bool:
    """Each row of ``real`` has ``guess``'s first ``counts[b]`` page ids."""
    if same_array(real, guess):
        return True
    width = int(counts.max())
    if real.shape[1] < width or guess.shape[1] < width:
        return False
    used = np.arange(width)[None, :] < counts[:, None]
    return bool(np.all((real[:, :width] == guess[:, :width]) | ~used))


def committed_lens(step: SpecStep) -> np.ndarray:
    """[B] int32: each request's target KV length before the step's verify, which is also
    the logical index of its root (the last token, whose KV the verify writes first)."""
    return (step.cached_lens + step.q_lens - 1).astype(np.int32)


def same_requests(a: SpecStep, b: SpecStep) -> bool:
    """The two plans carry the same requests with the same pending tokens and lengths."""
    return (same_array(a.keys, b.keys) and same_array(a.q_lens, b.q_lens)
            and same_array(a.cached_lens, b.cached_lens)
            and same_array(a.token_ids, b.token_ids))


class Drafter:
    def __init__(self, runner: ModelRunner, draft: Eagle3Draft, draft_kv: KVCache,
                 cfg: SpecConfig, aux_layers: tuple[int, ...],
                 embed: torch.nn.Module | None = None, drafting_rank: int | None = None,
                 rank: int = 0, world: int = 1) -> None:
        self.runner, self.draft, self.draft_kv, self.cfg = runner, draft, draft_kv, cfg
        # One rank drafts (``drafting_rank``) and hands the tree to the others in one
        # collective (``_hand_over``), or (None) every rank drafts the same tree. Only the
        # drafting ranks run the draft's forwards and write its KV; every rank keeps the same
        # pending features (rank 0 plans with their counts).
        self.drafting_rank = drafting_rank
        self.drafts = drafting_rank is None or rank == drafting_rank
        self.world = world
        # The token embedding the draft reads (a whole replica when the draft is not sharded,
        # so drafting issues no collective); default: the target's own.
        self.embed = embed if embed is not None else runner.model.embed_tokens
        # Our forward returns aux states in layer order; fc wants the config's order.
        self.aux_sorted = tuple(sorted(aux_layers))
        self.aux_order = [self.aux_sorted.index(i) for i in aux_layers]
        self.pending: dict[int, torch.Tensor] = {}
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}  # see _node_index
        # Seconds the last plain step spent feeding the draft after the target forward (the
        # followed requests' projections, deferred rows, extend): what following cost it.
        self.feed_seconds = 0.0
        # Trees grown by the one native call vs the per-depth loop (reported in the stats).
        # Trees grown ahead (``run_ahead``) that the next plan used, or that it did not.
        # Of the trees grown ahead, those whose plan rank 0 confirmed as guessed (``Guessed``).
        self.trees = {"native": 0, "loop": 0, "ahead": 0, "ahead_wasted": 0, "guessed": 0,
                      "ahead_layout": 0}
        # The drafting rank's counts ride with each tree it hands over, as changes since the
        # last one (small integers: exact in the fp32 allreduce): ``_trees_sent`` there, the
        # running sum on every other rank in ``drafting_trees`` (what rank 0 reports).
        self._trees_sent = dict.fromkeys(self.trees, 0)
        self.drafting_trees = dict.fromkeys(self.trees, 0)
        self.ahead: Ahead | None = None
        self.page_features = torch.zeros(draft_kv.cfg.num_pages, draft.cfg.base.hidden_size,
                                         dtype=draft.fc.weight.dtype, device=runner.device)
        self._build_static()

    def _build_static(self) -> None:
        """The fixed-shape draft and verify forwards (captured / compiled per tree shape)."""
        model = self.runner.model
        self.verify_forward = verify_forward(model, self.runner.kv.layers, self.draft,
                                             self.aux_sorted, self.aux_order,
                                             self.cfg.num_draft_tokens)
        self.draft_forward = draft_forward(self.draft, self.embed,
                                           self.draft_kv.layers[0], self.cfg.topk,
                                           self.draft.cfg.base.hidden_size,
                                           self.draft.fc.weight.dtype)

    def set_tree_shape(self, cfg: SpecConfig) -> None:
        """A live change of the tree shape: only the draft and verify forwards are rebuilt
        (and recaptured / recompiled); target decode is unaffected."""
        if cfg == self.cfg:
            return
        self.cfg = cfg
        self._build_static()
        refresh = getattr(self.runner.static, "refresh", None)
        if refresh is not None:
            refresh([self.verify_forward, self.draft_forward])

    def forget(self, keys: np.ndarray) -> None:
        for key in keys.tolist():
            self.pending.pop(key, None)

    def _features(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.draft.project(torch.cat([aux[i] for i in self.aux_order], dim=-1))

    @torch.inference_mode()
    def feed(self, step: ForwardStep, host_work: Callable[[], None] | None = None
             ) -> ForwardOutput:
        """A plain target forward, with aux states when the draft follows any of its
        requests; then the draft over those requests' tokens."""
        assert step.feed is not None
        feed = step.feed
        self.forget(feed.drop)
        self.feed_seconds = 0.0
        if not len(feed.rows):
            return self.runner.forward(step, step.logit_rows, host_work=host_work,
                                       greedy=step.greedy)
        out = self.runner.forward(step, step.logit_rows, self.aux_sorted, host_work=host_work,
                                  greedy=step.greedy)
        start = time.perf_counter()
        self._feed_rows(step, feed, out)
        self.feed_seconds = time.perf_counter() - start
        return out

    def _feed_rows(self, step: ForwardStep, feed: DraftFeed, out: ForwardOutput) -> None:
        """The followed requests' features, pending or extended into the draft."""
        row_starts = np.cumsum(step.q_lens) - step.q_lens
        q_lens = step.q_lens[feed.rows]
        if len(feed.rows) == len(step.q_lens):
            feats = self._features(out.aux)
        else:  # project only the followed requests' rows
            index = np.concatenate([np.arange(r0, r0 + q) for r0, q in
                                    zip(row_starts[feed.rows].tolist(), q_lens.tolist(),
                                        strict=True)])
            picked = torch.from_numpy(index).to(self.runner.device, non_blocking=True)
            feats = self._features([a.index_select(0, picked) for a in out.aux])
        prev_ends = np.cumsum(feed.prev_lens)
        rows, toks, starts, extended = [], [], [], []
        at = 0
        for j, (b, key) in enumerate(zip(feed.rows.tolist(), feed.keys.tolist(), strict=True)):
            q, cached, r0 = int(step.q_lens[b]), int(step.cached_lens[b]), int(row_starts[b])
            new = feats[at : at + q]
            at += q
            chunk = torch.from_numpy(step.token_ids[r0 : r0 + q]).long()
            if feed.defer is not None and feed.defer[j]:  # written by a later extend
                self.pending[key] = torch.cat([self.pending[key], new])
                continue
            extended.append(b)
            if feed.fresh[j] and cached == 0:  # a new sequence: token 0 has no draft row
                rows.append(new[: q - 1])
                toks.append(chunk[1:])
                starts.append(0)
            elif feed.fresh[j]:  # starts on cached pages: seed with the last page's feature
                page = int(step.page_table[b, (cached - 1) // self.draft_kv.cfg.page_size])
                rows.append(torch.cat([self.page_features[page : page + 1], new[: q - 1]]))
                toks.append(chunk)
                starts.append(cached - 1)
            else:
                # After a speculative step m > 1 features can be pending (the accepted path);
                # they pair with the m - 1 tokens before this chunk, which the step carries.
                held = self.pending[key]
                end = int(prev_ends[j])
                prev = torch.from_numpy(feed.prev_tokens[end - int(feed.prev_lens[j]) : end])
                rows.append(torch.cat([held, new[: q - 1]]))
                toks.append(torch.cat([prev.long(), chunk]))
                starts.append(cached - len(held))
            self.pending[key] = new[q - 1 :]
        # (a batch of one-token prompts has nothing to extend)
        if self.drafts and any(len(t) for t in toks):
            self._draft_extend(rows, toks, starts, step.page_table[extended])

    def _draft_extend(self, rows: list[torch.Tensor], toks: list[torch.Tensor],
                      starts: list[int], page_table: np.ndarray) -> torch.Tensor:
        """Write committed draft KV for ``toks`` (paired with ``rows``); return each
        request's last output row."""
        lens = np.array([len(t) for t in toks], dtype=np.int32)
        device = self.runner.device
        self._remember_page_ends(rows, starts, page_table)
        layout = Layout(torch.cat(toks).numpy(), lens, np.array(starts, dtype=np.int32),
                        page_table)
        fb = build_forward_batch(layout, self.draft_kv.cfg.page_size, device)
        feats = torch.cat(rows).to(device=device, dtype=self.draft.fc.weight.dtype)
        out = self.draft(self.embed(fb.input_ids), feats, fb,
                         self.draft_kv.layers[0])
        last = torch.from_numpy(np.maximum(np.cumsum(lens) - 1, 0)).to(device, non_blocking=True)
        return out.index_select(0, last)

    def _remember_page_ends(self, rows: list[torch.Tensor], starts: list[int],
                            page_table: np.ndarray) -> None:
        """Keep the feature of each page's last position (see the module docstring)."""
        ps = self.draft_kv.cfg.page_size
        for b, (r, start) in enumerate(zip(rows, starts, strict=True)):
            if start % ps + len(r) < ps:
                continue  # no page ends inside this run
            offsets = torch.arange((-(start + 1)) % ps, len(r), ps)
            pages = torch.from_numpy(page_table[b, (start + offsets.numpy()) // ps]).long()
            dev = self.page_features.device
            self.page_features[pages.to(dev, non_blocking=True)] = r[
                offsets.to(r.device, non_blocking=True)]

    @torch.inference_mode()
    def run(self, step: SpecStep, phase: PhaseScope) -> Verified:
        """Draft extend + tree (part "draft"), then the target's verify forward ("verify")."""
        self.forget(step.drop)
        ahead, self.ahead = self.ahead, None
        with phase("draft"):
            committed = committed_lens(step).astype(np.int64)
            if ahead is not None and not ahead.fits(step):
                self.trees["ahead_wasted"] += 1
                ahead = None
            elif ahead is not None:
                self.trees["ahead"] += 1
            # Host-side layout of the verify batch, built before drafting queues device work.
            verify_meta = (ahead.verify_meta if ahead is not None and ahead.layout_fits(step)
                           else None)
            if verify_meta is not None:
                self.trees["ahead_layout"] += 1
            else:
                verify_meta = self._verify_meta(step)
            tree = ahead.tree if ahead is not None else None
            if tree is None and self.drafts:
                tree = self._draft(step)
        if self.drafting_rank is not None:
            with phase("tree"):
                tree = self._hand_over(tree, len(step.q_lens))
        assert tree is not None
        with phase("verify"):
            return self._verify(tree, verify_meta, step.page_table, committed)

    def _verify_meta(self, step: SpecStep) -> AttentionMetadata:
        cached = committed_lens(step)
        n = self.cfg.num_draft_tokens
        return tree_metadata(step.page_table, cached, n, cached, n, self.runner.page_size,
                             self.runner.device, chain=self.cfg.topk == 1)

    @torch.inference_mode()
    def run_ahead(self, step: SpecStep, verified: Verified) -> None:
        """On the drafting rank when it is not rank 0, right after verify: where rank 0's
        acceptance is the argmax of these same logits (``step.greedy``), work out its commit
        and the next plan (the same requests, each extended by its accepted tokens, on the
        pages it holds) and grow that plan's tree now, while rank 0 accepts, streams and
        plans. ``commit`` and ``run`` then only check the guess (a finished request, a new
        page, another message in between: the tree is grown again from the real plan).

        Nothing here touches what the real messages could disagree with: the paths'
        features become pending as ``keep`` would make them (redone if the commit differs),
        and the draft writes its KV only at indices from the root on (uncommitted, rewritten
        by the next extend) in pages the verify just wrote."""
        self.ahead = None
        if not (self.drafts and self.runs_ahead(step)):
            return
        tree = verified.tree
        guess = self.guess(step, greedy_paths(tree.tokens, tree.parents,
                                              verified.logits.float()))
        if guess is None:
            return
        self.keep(step.keys, verified, guess.paths)
        tree = self._draft(guess.step)
        # The verify layout too, where the request holds every page it reads (used where the
        # real plan keeps those pages: ``Ahead.layout_fits``).
        cfg, ps = self.cfg, self.draft_kv.cfg.page_size
        reads = [round_up(n + cfg.num_draft_tokens, ps) // ps for n in guess.lens]
        wide = all(r <= h for r, h in zip(reads, guess.held, strict=True))
        self.ahead = Ahead(guess.step, guess.paths, np.array(guess.reach), tree,
                           self._verify_meta(guess.step) if wide else None, np.array(reads))

    def _temporary_nodes(self) -> int:
        """How far past the next root the next tree's temporary draft nodes reach."""
        return max((self.cfg.num_steps - 1) * self.cfg.topk - 1, 0)

    def guess(self, step: SpecStep, accepted: Sequence[Accepted]) -> Guess | None:
        """The commit and next plan after greedy ``step`` whose argmax paths are ``accepted``,
        as the drafting follower assumes them (rank 0 checks its real ones against the same
        guess), or None where the next tree would reach past the pages the request holds in
        this step's plan (the scheduler keeps ``SpecConfig.reserve`` slots ahead, so it does
        not at the launch setting). Those pages are surely its own until a later message:
        a request that finishes or is preempted changes the plan, and the guess is void."""
        # Python ints: a handful of requests, where numpy's per-call cost dominates.
        roots = committed_lens(step).tolist()
        lens = [r + len(a.nodes) for r, a in zip(roots, accepted, strict=True)]
        ps, extra = self.draft_kv.cfg.page_size, self._temporary_nodes()
        held = held_pages(step.page_table)
        reach = [(n + extra) // ps + 1 for n in lens]
        if any(r > h for r, h in zip(reach, held, strict=True)):
            return None
        plan = SpecStep(np.array([t for a in accepted for t in a.tokens], dtype=np.int64),
                        np.array([len(a.nodes) for a in accepted], dtype=np.int32),
                        np.array([r + 1 for r in roots], dtype=np.int32), step.page_table,
                        step.keys, np.zeros(0, dtype=np.int64), True)
        return Guess(plan, [a.nodes for a in accepted], lens, held, reach)

    def guessed_by_all(self, step: SpecStep) -> bool:
        """Whether every other rank works out ``guess`` itself after ``step``: the drafting
        follower runs ahead and is the only other rank."""
        return self.runs_ahead(step) and self.world == 2

    def guessed(self, fingerprint: int, page_table: np.ndarray | None
                ) -> tuple[SpecCommit, SpecStep]:
        """On the drafting follower, for a ``Guessed`` message: the commit and plan it
        assumed when it drafted ahead (rank 0's guess has ``fingerprint``), with the real
        ``page_table`` where it differs."""
        ahead = self.ahead
        if ahead is None:
            raise RuntimeError("rank 0 confirmed a guess, but this rank drafted none ahead")
        if plan_fingerprint(ahead.step) != fingerprint:
            raise RuntimeError("rank 0 confirmed another guess than this rank's: the ranks' "
                               "verify logits differ")
        self.trees["guessed"] += 1
        step = (ahead.step if page_table is None
                else replace(ahead.step, page_table=page_table))
        return SpecCommit.of(ahead.paths), step

    def runs_ahead(self, step: SpecStep) -> bool:
        """Whether the drafting rank grows the next tree after this step's verify, before
        the commit and next plan arrive (``run_ahead``): one rank drafts, not rank 0, and
        rank 0 accepts by the argmax of the verify logits."""
        return step.greedy and self.drafting_rank not in (None, 0)

    def discard_ahead(self) -> None:
        """A message other than the next speculative step came: the guess is void."""
        if self.ahead is not None:
            self.trees["ahead_wasted"] += 1
            self.ahead = None

    def _draft(self, step: SpecStep) -> DraftTree:
        """Extend the draft over the plan's pending rows, then grow the tree: eagerly as one
        native call where it applies (the extend inside it when its rows fit too), else per
        depth (captured / compiled steps, other devices)."""
        device, cache, ps = self.runner.device, self.draft_kv.layers[0], self.draft_kv.cfg.page_size
        rows = [self.pending[k] for k in step.keys.tolist()]
        starts = step.cached_lens - 1  # the pending feature of token t is at t - 1
        committed = committed_lens(step)
        token_ids = np.ascontiguousarray(step.token_ids, dtype=np.int64)
        roots = torch.from_numpy(token_ids[np.cumsum(step.q_lens) - 1])
        native = (self.runner.static is None
                  and can_grow_natively(self.draft, self.embed, device))
        self.trees["native" if native else "loop"] += 1
        if native:
            self._remember_page_ends(rows, starts.tolist(), step.page_table)
            feats = (rows[0] if len(rows) == 1 else torch.cat(rows)).to(
                device=device, dtype=self.draft.fc.weight.dtype)
            # int32 host tensors, as the op reads them (no round trip through int64)
            extend = (torch.from_numpy(token_ids), torch.from_numpy(step.q_lens.astype(np.int32, copy=False)),
                      torch.from_numpy(starts.astype(np.int32)))
            return grow_natively(self.draft, self.embed, cache, feats, roots,
                                 torch.from_numpy(step.page_table.astype(np.int32, copy=False)),
                                 torch.from_numpy(committed), self.cfg, ps, extend)
        toks = list(torch.from_numpy(token_ids).split(step.q_lens.tolist()))
        root_out = self._draft_extend(rows, toks, starts.tolist(), step.page_table)
        return draft_tree(self.draft, self.embed, cache, root_out, roots,
                          torch.from_numpy(step.page_table).long(),
                          torch.from_numpy(committed).long(), self.cfg, ps, self._draft_step)

    def _hand_over(self, tree: DraftTree | None, batch: int) -> DraftTree:
        """The drafting rank's tree on every rank: one allreduce of the packed tree (tokens,
        parents, depths, mask as fp32, exact below 2**24; the other ranks add zeros), followed
        by the changes of the drafting rank's tree counts in row 0 (``tree_counts``).

        Why one rank: on CPU the ranks share the cores, and every rank drafting the same tree
        spent rank 0's core on it (~1.2 ms a step on the demo pair at TP = 2) while rank 0's
        own host work (acceptance, streaming, KV compaction, the next plan) ran before or
        after it, all on the step's critical path. With the draft on the last rank, rank 0
        compacts KV and streams output while it drafts."""
        n = self.cfg.num_draft_tokens
        width = 3 * n + n * n  # the tree's columns
        # Packed and unpacked through numpy: this collective sits on the step's critical
        # path on both ranks (the drafting one packs, the others unpack before verify), and
        # the torch ops (zeros, cat, casts, slices) cost ~60 us a side on the demo pair at
        # TP = 2 where numpy's take ~10. (Where the tree lives on a GPU it goes through the
        # host: ``--speculative-draft-ranks one`` is the CPU default, on GPUs only asked for.)
        device = self.runner.device
        if tree is None:
            packed = np.zeros((batch, width + len(self.trees)), dtype=np.float32)
        else:
            counts = np.zeros((batch, len(self.trees)), dtype=np.float32)
            counts[0] = [v - self._trees_sent[key] for key, v in self.trees.items()]
            self._trees_sent = dict(self.trees)
            parts = (tree.tokens, tree.parents, tree.depths, tree.mask.reshape(batch, n * n))
            packed = np.concatenate([t.cpu().numpy() for t in parts] + [counts], axis=1,
                                    dtype=np.float32)
        assert self.runner.comm is not None
        whole = self.runner.comm.all_reduce(torch.from_numpy(packed).to(device))
        if tree is not None:  # the sum is this rank's own tree: no need to unpack it
            return tree
        summed = whole.cpu().numpy()
        for key, change in zip(self.trees, summed[0, width:].tolist(), strict=True):
            self.drafting_trees[key] += int(change)
        ints = summed[:, :width].astype(np.int64)
        nodes = torch.from_numpy(ints).to(device)
        mask = torch.from_numpy(ints[:, 3 * n :].reshape(batch, n, n) != 0).to(device)
        return DraftTree(nodes[:, :n], nodes[:, n : 2 * n], nodes[:, 2 * n : 3 * n], mask)

    def tree_counts(self) -> dict[str, int]:
        """Trees grown, by how: this rank's own, or where another rank drafts for all, that
        rank's as of the last tree it handed over."""
        return dict(self.trees if self.drafts else self.drafting_trees)

    def reset_tree_counts(self) -> None:
        """Zero the counts (the statistics reset). The drafting rank keeps sending changes
        since its last hand-over, so the other ranks' sums restart from zero too."""
        self.trees = dict.fromkeys(self.trees, 0)
        self._trees_sent = dict.fromkeys(self.trees, 0)
        self.drafting_trees = dict.fromkeys(self.trees, 0)

    def _draft_step(self, fb: ForwardBatch, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, logp = run_static(self.runner.static, self.draft_forward, fb, {"hidden": hidden})
        return out, logp

    def _verify(self, tree: DraftTree, meta: AttentionMetadata, pages: np.ndarray,
                committed: np.ndarray) -> Verified:
        batch, n = tree.tokens.shape
        base = torch.from_numpy(committed[:, None])
        positions = tree.depths + (base if tree.depths.is_cpu
                                   else base.to(tree.depths.device, non_blocking=True))
        self.runner.threads.fit(batch * n)
        fb = with_inputs(meta, tree.tokens, positions, tree.mask)
        logits, feats = run_static(self.runner.static, self.verify_forward, fb, {})
        return Verified(tree, logits.view(batch, n, -1), feats.view(batch, n, -1), pages,
                        committed)

    def commit(self, keys: np.ndarray, verified: Verified, paths: list[list[int]]) -> None:
        """Keep the paths' features (unless ``run_ahead`` already kept these very paths),
        then compact the accepted target KV."""
        if self.ahead is None or self.ahead.paths != paths:
            self.discard_ahead()
            self.keep(keys, verified, paths)
        self.compact(verified, paths)

    @torch.inference_mode()
    def keep(self, keys: np.ndarray, verified: Verified, paths: list[list[int]]) -> None:
        """The accepted paths' features become the requests' pending rows (what the next
        plan counts). The row index comes from a cache on the device (``_node_index``):
        nothing here waits for the device."""
        n = verified.features.shape[1]
        kept = verified.features.reshape(-1, verified.features.shape[2]).index_select(
            0, self._node_index(tuple(b * n + node for b, path in enumerate(paths)
                                      for node in path)))
        if len(paths) == 1:  # batch 1: the whole selection is the one request's
            self.pending[int(keys[0])] = kept
            return
        for key, feats in zip(keys.tolist(), kept.split([len(p) for p in paths]), strict=True):
            self.pending[key] = feats

    def _node_index(self, flat: tuple[int, ...]) -> torch.Tensor:
        """The accepted nodes' rows as an index tensor on the device, cached: a batch meets
        few distinct paths (a tree of N nodes has at most N per request), and building the
        tensor took longer than the selection itself."""
        index = self._indices.get(flat)
        if index is None:
            if len(self._indices) >= 4096:
                self._indices.clear()
            index = torch.tensor(flat, dtype=torch.long)
            if self.runner.device.type != "cpu":
                index = index.to(self.runner.device)
            self._indices[flat] = index
        return index

    @torch.inference_mode()
    def compact(self, verified: Verified, paths: list[list[int]]) -> None:
        """Move the accepted nodes' target KV to consecutive slots (node n at position i of
        its path moves down to committed + i, n >= i). Must run before the next forward."""
        moves = moved_slots(verified.pages, verified.committed.tolist(), paths,
                            self.runner.page_size)
        if moves is not None:
            self.runner.kv.move_slots(*moves)


def moved_slots(pages: np.ndarray, committed: list[int], paths: list[list[int]],
                page_size: int) -> tuple[list[int], list[int]] | None:
    """(source, destination) cache slots of the accepted nodes that are not already in place
    (request b's path node n at position i lives at logical index committed[b] + n and
    belongs at committed[b] + i), or None when every node is in place (a chain's path
    always is). ``pages`` [B, P] page ids. Python ints: a step moves a handful of slots."""
    src: list[int] = []
    dst: list[int] = []
    for b, path in enumerate(paths):
        row = pages[b]
        for i, node in enumerate(path):
            if node != i:
                for out, logical in ((src, committed[b] + node), (dst, committed[b] + i)):
                    out.append(int(row[logical // page_size]) * page_size + logical % page_size)
    return (src, dst) if src else None
