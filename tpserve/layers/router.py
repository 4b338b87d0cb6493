"""Expert routing: which ``top_k`` experts each token uses, and with what weights.

Two rules, both computed in float32 on every rank from the same replicated gate weight, so
every rank takes the same decisions:

- softmax (Qwen3-MoE, Mixtral): softmax over all experts, top-k, optionally renormalised;
- sigmoid with ``noaux_tc`` (DeepSeek-V3, Kimi-K2): sigmoid scores; the correction bias is
  added for *selection only* (the weights are the unbiased scores); experts are split into
  ``n_group`` groups, a group's score is the sum of its two best biased scores, only the
  ``topk_group`` best groups stay eligible; weights optionally renormalised, then scaled by
  ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.models.config_families import MoEConfig


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor | None, cfg: MoEConfig
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        keep = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class Router(nn.Module):
    """The gate: weight [E, H] (and the noaux_tc correction bias [E]), float32, replicated."""

    def __init__(self, hidden: int, cfg: MoEConfig, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, device=device),
                                   requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts, device=device), requires_grad=False)
            if cfg.correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, top_k] float32, expert ids [N, top_k] int64)."""
        logits = F.linear(x.float(), self.weight)
        if self.cfg.scoring == "sigmoid":
            return grouped_sigmoid_topk(logits, self.e_score_correction_bias, self.cfg)
        weights, ids = softmax_topk(logits, self.cfg.top_k, self.cfg.norm_topk_prob)
        return weights * self.cfg.routed_scaling_factor, ids
