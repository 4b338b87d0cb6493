"""What every decoder-only model of the MLA / MoE families shares with the engine.

``DecoderLM`` owns the embedding, the layer loop (with EAGLE-3 auxiliary hidden states, as
``llama.py``), the final norm, the vocab-parallel head, and the checkpoint-name mapping:
parameter names follow the checkpoint's, except fused projections (``qkv_proj``,
``gate_up_proj``) and stacked experts (``experts.w13`` / ``experts.w2`` hold every expert;
the checkpoint has one tensor per expert and projection).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.layers.norm import RMSNorm
from tpserve.layers.rotary import RotaryEmbedding
from tpserve.layers.tp import TPContext
from tpserve.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from tpserve.models.config import ModelConfig

Names = dict[str, tuple[str, int | None]]

FUSED = (
    ("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DecoderLM(nn.Module):
    # Checkpoint names of an expert's (gate, up, down) projections.
    EXPERT_NAMES: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # (our name part, checkpoint name part) where a checkpoint names a module differently
    CHECKPOINT_RENAMES: tuple[tuple[str, str], ...] = ()
    # The attention a model starts with; ``build_model`` then applies the requested one.
    START_ATTENTION = "auto"

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, layers: list[nn.Module], rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype,
                                                   device)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.rotary = rotary
        self.set_attention_backend(self.START_ATTENTION)

    def set_attention_backend(self, name: str) -> None:
        """``--attention-backend``: the family's attention, prepared once per step."""
        raise NotImplementedError

    def bind_attention(self, batch: ForwardBatch) -> Any:
        """What every layer's attention receives for this step."""
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, kv: list[tuple[torch.Tensor, ...]],
                aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns final-normed hidden [N, H] and the inputs of ``aux_layers`` (same shape)."""
        if not torch.compiler.is_compiling():
            batch.host_work.run()  # layer by layer from Python: no long native call to wait for
        x = self.embed_tokens(batch.input_ids)
        rotary = self.rotary.at(batch.positions, x.dtype)
        attend = self.bind_attention(batch)
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            x = layer(x, rotary, attend, kv[i])
        if self.cfg.num_layers in aux_layers:
            aux.append(x)
        return self.norm(x), aux

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def picks_greedy(self) -> bool:
        """Whether ``greedy_picks`` is what greedy sampling from ``logits`` would pick: the
        plain head (a model that scales or caps its logits overrides ``logits``) with the
        native picks (``ParallelLMHead.picks_greedy``)."""
        return type(self).logits is DecoderLM.logits and self.lm_head.picks_greedy

    def greedy_picks(self, hidden: torch.Tensor) -> tuple[list[int], list[float]]:
        """(tokens, log-probabilities) of greedy picks from final-normed ``hidden`` rows,
        without the logits leaving native code (``ParallelLMHead.greedy``)."""
        return self.lm_head.greedy(hidden)

    def ignored_checkpoint_tensor(self, name: str) -> bool:
        """Tensors a checkpoint may hold that this model never loads: multi-token-prediction
        layers (``model.layers.{i}`` with i >= num_hidden_layers, DeepSeek-V3 / Kimi-K2)."""
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= self.cfg.num_layers

    def finish_loading(self) -> None:
        """Post-load steps of the layers (e.g. MLA's split of kv_b_proj)."""
        for module in [m for m in self.modules() if m is not self]:
            if hasattr(module, "finish_loading"):
                module.finish_loading()

    def checkpoint_names(self) -> Names:
        """Map every checkpoint tensor name to (our parameter name, shard id)."""
        mapping: Names = {}
        for name, _ in self.named_parameters():
            hf = name if name.startswith("lm_head") else "model." + name
            for ours, theirs in self.CHECKPOINT_RENAMES:
                hf = hf.replace(ours, theirs)
            if ".experts.w" in hf:
                mapping.update(self._expert_names(name, hf))
                continue
            fused = [(c, o, s) for c, o, s in FUSED if f".{o}." in hf]
            for ckpt, ours, shard in fused:
                mapping[hf.replace(f".{ours}.", f".{ckpt}.")] = (name, shard)
            if not fused:
                mapping[hf] = (name, None)
        return mapping

    def _expert_names(self, name: str, hf: str) -> Names:
        prefix, param = hf.rsplit(".", 1)  # "...experts", "w13" | "w2" | "w13_scale_inv" ...
        suffix = "weight_scale_inv" if param.endswith("_scale_inv") else "weight"
        kinds = (0, 1) if param.startswith("w13") else (2,)
        count = self.cfg.moe.num_experts if self.cfg.moe else 0
        return {f"{prefix}.{e}.{self.EXPERT_NAMES[k]}.{suffix}": (name, 3 * e + k)
                for e in range(count) for k in kinds}
