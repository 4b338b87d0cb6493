"""The speculative decode step, run by every rank (rank 0 drives; followers mirror it).

State kept on every rank per request (keyed by an integer rank 0 assigns): the draft
features (``fc`` of the target's aux states) for the last tokens whose draft KV is not yet
written. The draft row for token t pairs embed(token t) with the feature of position t - 1 and
is stored at draft KV index t - 1, so the draft KV shares the request's page table.

One step over a decode batch, with L = seq_len and the root = token L - 1:
1. plan "spec" (rank 0 -> all): pending tokens, page table, cached lengths, keys, drops.
2. draft extend over the pending tokens (writes committed draft KV, ends at the root's row).
3. drafting: a tree of N nodes (identical on every rank, no communication).
4. verify: one target forward over the tree (tree mask, depth positions) with aux states.
5. rank 0 accepts (it owns the generators) and sends "spec_commit": accepted path per request.
6. every rank moves the accepted nodes' target KV to consecutive slots and keeps the path's
   features as the new pending rows (their draft KV is written by the next step's extend).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.engine.kv_cache import KVCache
from tpserve.engine.phases import draft_phase, run_phase, verify_phase
from tpserve.engine.plan import StepPlan, build_forward_batch
from tpserve.engine.runner import ForwardOutput, ModelRunner
from tpserve.models.eagle3 import Eagle3Draft
from tpserve.spec.config import SpecConfig
from tpserve.spec.eagle import draft_tree
from tpserve.spec.tree import DraftTree, slots


@dataclass
class Verified:
    tree: DraftTree
    logits: torch.Tensor  # [B, N, V]
    features: torch.Tensor  # [B, N, H] fc'd target features of every node
    pages: torch.Tensor
    committed: torch.Tensor  # [B] target KV length before the step (= L - 1)


class SpecDecoder:
    def __init__(self, runner: ModelRunner, draft: Eagle3Draft, draft_kv: KVCache,
                 cfg: SpecConfig, aux_layers: tuple[int, ...]) -> None:
        self.runner, self.draft, self.draft_kv, self.cfg = runner, draft, draft_kv, cfg
        # Our forward returns aux states in layer order; fc wants the config's order.
        self.aux_sorted = tuple(sorted(aux_layers))
        self.aux_order = [self.aux_sorted.index(i) for i in aux_layers]
        self.pending: dict[int, torch.Tensor] = {}
        self.timing: dict[str, float] = {}
        # Fixed-shape phases: run through runner.static (CUDA graphs / compile) when set.
        model = runner.model
        self.verify_phase = verify_phase(model, runner.kv.layers, draft, self.aux_sorted,
                                         self.aux_order, cfg.num_draft_tokens)
        self.draft_phase = draft_phase(draft, model.embed_tokens, draft_kv.layers[0], cfg.topk,
                                       draft.cfg.base.hidden_size, draft.fc.weight.dtype)

    def on_config_change(self) -> None:
        """The tree shape changed live: rebuild the verify and draft phases, and have the
        static executor recapture/recompile only those (target decode is unaffected)."""
        model = self.runner.model
        self.verify_phase = verify_phase(model, self.runner.kv.layers, self.draft, self.aux_sorted,
                                         self.aux_order, self.cfg.num_draft_tokens)
        self.draft_phase = draft_phase(self.draft, model.embed_tokens, self.draft_kv.layers[0],
                                       self.cfg.topk, self.draft.cfg.base.hidden_size,
                                       self.draft.fc.weight.dtype)
        refresh = getattr(self.runner.static, "refresh", None)
        if refresh is not None:
            refresh([self.verify_phase, self.draft_phase])

    # ---- shared by every rank ----

    def _phase(self, name: str) -> None:
        if self.runner.comm is not None:
            self.runner.comm.set_phase(name)

    def _tick(self, name: str, start: float) -> float:
        now = time.perf_counter()
        self.timing[name] = self.timing.get(name, 0.0) + now - start
        return now

    def _features(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.draft.project(torch.cat([aux[i] for i in self.aux_order], dim=-1))

    def _apply_drops(self, plan: StepPlan) -> None:
        for key in plan.extra.get("spec_drop", ()):
            self.pending.pop(key, None)

    @torch.inference_mode()
    def prefill(self, plan: StepPlan) -> ForwardOutput:
        """Target prefill chunk with aux states, then the draft over the same chunk."""
        self._apply_drops(plan)
        # No phase tag here: the caller (prefill, or a plain decode step while speculation is
        # switched off) has already tagged its allreduces.
        out = self.runner.forward(plan, self.aux_sorted)
        feats = self._features(out.aux)
        q_max = plan.token_ids.shape[1]
        rows, toks, starts = [], [], []
        for b, key in enumerate(plan.extra["spec_keys"]):
            q, cached = int(plan.q_lens[b]), int(plan.cached_lens[b])
            new = feats[b * q_max : b * q_max + q]
            chunk = torch.from_numpy(plan.token_ids[b, :q]).long()
            if cached == 0:  # a new (or recomputed) sequence: token 0 has no draft row
                rows.append(new[: q - 1])
                toks.append(chunk[1:])
                starts.append(0)
            else:
                # After a speculative step m > 1 features can be pending (the accepted path);
                # they pair with the m - 1 tokens before this chunk, which the plan carries.
                held = self.pending[key]
                prev = torch.tensor(plan.extra["spec_prev_tokens"][b], dtype=torch.long)
                rows.append(torch.cat([held, new[: q - 1]]))
                toks.append(torch.cat([prev, chunk]))
                starts.append(cached - len(held))
            self.pending[key] = new[q - 1 :]
        if any(len(t) for t in toks):  # a batch of one-token prompts has nothing to extend
            self._draft_extend(rows, toks, starts, plan.page_table)
        return out

    def _draft_extend(self, rows: list[torch.Tensor], toks: list[torch.Tensor],
                      starts: list[int], page_table: np.ndarray) -> torch.Tensor:
        """Write committed draft KV for ``toks`` (paired with ``rows``); return last outputs."""
        lens = [len(t) for t in toks]
        q_max = max(max(lens), 1)
        batch = len(toks)
        tokens = np.zeros((batch, q_max), dtype=np.int64)
        hidden_size = self.draft.cfg.base.hidden_size
        device = self.runner.device
        feats = torch.zeros(batch, q_max, hidden_size, dtype=self.draft.fc.weight.dtype,
                            device=device)
        for b, (t, r) in enumerate(zip(toks, rows, strict=True)):
            tokens[b, : len(t)] = t.numpy()
            feats[b, : len(t)] = r
        plan = StepPlan(kind="draft", token_ids=tokens, q_lens=np.array(lens, dtype=np.int32),
                        cached_lens=np.array(starts, dtype=np.int32), page_table=page_table)
        fb = build_forward_batch(plan, self.draft_kv.cfg.page_size, None, device)
        embeds = self.runner.model.embed_tokens(fb.input_ids.reshape(-1))
        out = self.draft(embeds, feats.reshape(batch * q_max, -1), fb, self.draft_kv.layers[0])
        last = torch.tensor([b * q_max + max(n - 1, 0) for b, n in enumerate(lens)],
                            device=device)
        return out.index_select(0, last)

    @torch.inference_mode()
    def draft_and_verify(self, plan: StepPlan) -> Verified:
        self._apply_drops(plan)
        start = time.perf_counter()
        self._phase("draft")
        keys = plan.extra["spec_keys"]
        lens = plan.q_lens.tolist()
        toks = [torch.from_numpy(plan.token_ids[b, :n]).long() for b, n in enumerate(lens)]
        rows = [self.pending[k] for k in keys]
        starts = (plan.cached_lens - 1).tolist()  # pending feature of token t is at t - 1
        root_out = self._draft_extend(rows, toks, starts, plan.page_table)
        pages = torch.from_numpy(plan.page_table).long()
        committed = torch.from_numpy(plan.cached_lens + plan.q_lens - 1).long()
        roots = torch.tensor([int(plan.token_ids[b, n - 1]) for b, n in enumerate(lens)])
        tree = draft_tree(self.draft, self.runner.model.embed_tokens, self.draft_kv.layers[0],
                          root_out, roots, pages, committed, self.cfg,
                          self.draft_kv.cfg.page_size, self._draft_step)
        start = self._tick("draft", start)
        self._phase("verify")
        out = self._verify_forward(tree, pages, committed)
        self._tick("verify_forward", start)
        self._phase("other")
        return out

    def _draft_step(self, fb: ForwardBatch, hidden: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, logp = run_phase(self.runner.static, self.draft_phase, fb, {"hidden": hidden})
        return out, logp

    def _verify_forward(self, tree: DraftTree, pages: torch.Tensor,
                        committed: torch.Tensor) -> Verified:
        batch, n = tree.tokens.shape
        plan = StepPlan(kind="verify", token_ids=tree.tokens.numpy(),
                        q_lens=np.full(batch, n, dtype=np.int32),
                        cached_lens=committed.numpy().astype(np.int32),
                        page_table=pages.numpy())
        model = self.runner.model
        fb = build_forward_batch(plan, self.runner.page_size, model.cfg.sliding_window,
                                 self.runner.device, tree_mask=tree.mask, depths=tree.depths)
        logits, feats = run_phase(self.runner.static, self.verify_phase, fb, {})
        return Verified(tree, logits.view(batch, n, -1), feats.view(batch, n, -1), pages,
                        committed)

    @torch.inference_mode()
    def commit(self, keys: list[int], verified: Verified, paths: list[list[int]]) -> None:
        """Compact accepted target KV to consecutive slots; keep the path's features."""
        start = time.perf_counter()
        src, dst = [], []
        for b, path in enumerate(paths):
            base = int(verified.committed[b])
            moved = [(base + node, base + i) for i, node in enumerate(path) if node != i]
            if moved:
                s, d = zip(*moved, strict=True)
                src.append(slots(verified.pages[b : b + 1], torch.tensor([s]), self.runner.page_size))
                dst.append(slots(verified.pages[b : b + 1], torch.tensor([d]), self.runner.page_size))
            self.pending[keys[b]] = verified.features[b, path]
        if src:
            device = self.runner.device
            self.runner.kv.move_slots(torch.cat(src, 1)[0].to(device),
                                      torch.cat(dst, 1)[0].to(device))
        self._tick("commit", start)

    def follow_step(self, plan: StepPlan, channel: Any) -> None:
        verified = self.draft_and_verify(plan)
        commit: StepPlan = channel.recv()
        self.commit(plan.extra["spec_keys"], verified, commit.extra["paths"])
