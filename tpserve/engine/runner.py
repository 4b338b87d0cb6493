"""Executes forward steps on one rank: build the batch, run the model, return logits.

Decode steps (one query per request, no aux states) go through ``static`` when one is set
(CUDA graphs or torch.compile, see ``engine/static_forward.py``); other steps, and decode
batches larger than every bucket, run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tpserve.dist import CommSwitch
from tpserve.engine.forward_batch import ForwardBatch, HostWork
from tpserve.engine.kv_cache import KVCache
from tpserve.engine.plan import BatchLayout, build_forward_batch
from tpserve.engine.static_forward import StaticExecutor, StaticForward, decode_forward, run_static
from tpserve.engine.step_threads import StepThreads


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [len(logit_rows), V] float32, identical on every rank
    # [N, H] final-normed hidden states, one row per fed token (None where a greedy step's
    # head ran natively: nothing reads a plain step's hidden states)
    hidden: torch.Tensor | None
    aux: list[torch.Tensor]
    # A greedy step's (tokens, float32 log-probabilities), one per logit row, instead of the
    # logits (``ModelRunner.forward``'s ``greedy``), identical on every rank.
    picks: tuple[list[int], list[float]] | None = None


class ModelRunner:
    def __init__(self, model: Any, kv: KVCache, device: torch.device,
                 comm: CommSwitch | None = None) -> None:
        self.model = model
        self.comm = comm
        self.kv = kv
        self.device = device
        self.page_size = kv.cfg.page_size
        self.decode_forward: StaticForward = decode_forward(model, kv.layers)
        self.static: StaticExecutor | None = None  # set by static_setup.install_static
        self.graph_info: dict[str, Any] = {}  # capture/compile report for server info
        self.threads = StepThreads.for_device(device)
        # Fixed once the model is built: looked up here, not through its properties each step.
        self._model_picks = bool(getattr(model, "picks_greedy", False))
        self._forward_picks = getattr(model, "forward_picks", None)

    @property
    def picks_greedy(self) -> bool:
        """Whether a step may ask ``forward`` for greedy picks instead of logits: the model's
        head picks natively (``DecoderLM.picks_greedy``) and steps run eagerly (a captured
        or compiled decode returns logits)."""
        return self.static is None and self._model_picks

    @torch.inference_mode()
    def forward(self, step: BatchLayout, logit_rows: Any, aux_layers: tuple[int, ...] = (),
                host_work: Callable[[], None] | None = None,
                greedy: bool = False) -> ForwardOutput:
        """Run ``step``; logits only for ``logit_rows`` (rows of the ragged batch), or with
        ``greedy`` (only where ``picks_greedy``) those rows' greedy picks.
        ``host_work`` runs once during the forward (``HostWork``)."""
        self.threads.fit(len(step.token_ids))
        batch = build_forward_batch(step, self.page_size, self.device)
        batch.host_work = work = HostWork(host_work)
        if self.static is not None:
            work.run()  # a compiled run or a graph replay has no Python inside to run it
        try:
            if greedy:
                return self._pick(batch, logit_rows, aux_layers)
            if batch.queries == 1 and not aux_layers:
                logits, hidden = run_static(self.static, self.decode_forward, batch, {})
                if self.static is None and every_row(logit_rows, logits.shape[0]):
                    # A fresh tensor already in order (a captured graph's is its reused
                    # output buffer, and padded): the copy was ~0.3 ms a step at batch 16.
                    return ForwardOutput(logits=logits, hidden=hidden, aux=[])
                return ForwardOutput(logits=logits.index_select(0, self._rows(logit_rows)),
                                     hidden=hidden, aux=[])
            hidden, aux = self.model(batch, self.kv.layers, aux_layers)
            logits = self.model.logits(hidden.index_select(0, self._rows(logit_rows)))
            return ForwardOutput(logits=logits, hidden=hidden, aux=aux)
        finally:
            work.run()  # a model that never started it

    def _pick(self, batch: ForwardBatch, logit_rows: Any, aux_layers: tuple[int, ...]
              ) -> ForwardOutput:
        """A greedy step: the picks of ``logit_rows``, natively from the layer stack on where
        the model can (``forward_picks``)."""
        rows = None if every_row(logit_rows, batch.num_rows) else self._rows(logit_rows)
        native = self._forward_picks
        out = native(batch, self.kv.layers, aux_layers, rows) if native is not None else None
        if out is not None:
            return ForwardOutput(logits=None, hidden=None, aux=out[1], picks=out[0])
        hidden, aux = self.model(batch, self.kv.layers, aux_layers)
        picked = hidden if rows is None else hidden.index_select(0, rows)
        return ForwardOutput(logits=None, hidden=hidden, aux=aux,
                             picks=self.model.greedy_picks(picked))

    def _rows(self, logit_rows: Any) -> torch.Tensor:
        return torch.as_tensor(logit_rows, dtype=torch.long).to(self.device)


def every_row(logit_rows: Any, rows: int) -> bool:
    """Whether ``logit_rows`` is 0, 1, ..., rows - 1: every row, in order. On Python lists:
    four numpy calls cost ~45 us a decode step here, run on caches the weight stream had just
    emptied (a list of a batch's rows is short)."""
    picked = logit_rows.tolist() if isinstance(logit_rows, np.ndarray) else list(logit_rows)
    return picked == list(range(rows))
