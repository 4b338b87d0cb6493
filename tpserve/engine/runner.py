"""Executes step plans on one rank: build the batch, run the model, return logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.dist import CommSwitch
from tpserve.engine.kv_cache import KVCache
from tpserve.engine.plan import StepPlan, build_forward_batch
from tpserve.models.llama import LlamaForCausalLM


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(plan.logit_rows), V] float32, identical on every rank
    hidden: torch.Tensor  # [B*Q, H] final-normed hidden states
    aux: list[torch.Tensor]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device: torch.device,
                 comm: CommSwitch | None = None) -> None:
        self.model = model
        self.comm = comm
        self.kv = kv
        self.device = device
        self.page_size = kv.cfg.page_size

    @torch.inference_mode()
    def forward(self, plan: StepPlan, aux_layers: tuple[int, ...] = ()) -> ForwardOutput:
        batch = build_forward_batch(plan, self.page_size, self.model.cfg.sliding_window, self.device)
        hidden, aux = self.model(batch, self.kv.layers, aux_layers)
        rows = torch.from_numpy(plan.logit_rows).long().to(self.device)
        logits = self.model.logits(hidden.index_select(0, rows))
        return ForwardOutput(logits=logits, hidden=hidden, aux=aux)
