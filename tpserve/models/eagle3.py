"""EAGLE-3 draft model in the published (EAGLE authors / SpecForge) checkpoint format.

One decoder "midlayer" whose q/k/v read concat(input_layernorm(embed), hidden_norm(hidden))
(width 2H), with the ``hidden`` input as the residual; ``fc`` maps the concatenation of three
target hidden states (3 * H_target) to H. Embeddings are not stored: the caller embeds tokens
with the target's ``embed_tokens``. The LM head covers a reduced draft vocabulary mapped back
to target ids by ``d2t`` (target_id = i + d2t[i]).

The draft is tensor-parallel like the target (column-parallel qkv / gate_up, row-parallel
o / down / fc, vocab-parallel head), reducing through the same ``TPContext.comm``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tpserve.engine.forward_batch import ForwardBatch
from tpserve.errors import ConfigError
from tpserve.layers.attention import AttentionBackend, bind
from tpserve.layers.attention import create as create_attention
from tpserve.layers.fused_decoder import DecoderStack, DraftBlocks
from tpserve.layers.linear import RowParallelLinear
from tpserve.layers.norm import RMSNorm
from tpserve.layers.rotary import RotaryEmbedding
from tpserve.layers.tp import TPContext
from tpserve.layers.vocab import ParallelLMHead
from tpserve.loader import load_weights, safetensors_files
from tpserve.models.config import ModelConfig, ModelConfigError, parse_config
from tpserve.models.llama import MLP, Attention, KVPair

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
DRAFT_FLAG = "--speculative-draft-model-path"


@dataclass(frozen=True)
class Eagle3Config:
    base: ModelConfig  # the midlayer's shape (hidden, heads, rope, ...); vocab = target vocab
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # "output of layer k" ids from the config, if any


def load_eagle3_config(path: str | Path) -> Eagle3Config:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ModelConfigError(f"draft model '{path}' has no config.json", DRAFT_FLAG)
    raw = json.loads(file.read_text())
    archs = raw.get("architectures") or []
    if archs and archs[0] not in ARCHITECTURES:
        raise ModelConfigError(f"draft architecture '{archs[0]}' is not EAGLE-3 "
                               f"(supported: {', '.join(ARCHITECTURES)})", DRAFT_FLAG)
    # The midlayer is a Llama decoder layer: reuse the Llama parser for its shape.
    base = parse_config({**raw, "architectures": ["LlamaForCausalLM"]})
    base = dataclasses.replace(base, architecture=archs[0] if archs else ARCHITECTURES[0])
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        base=base,
        draft_vocab_size=int(raw.get("draft_vocab_size") or base.vocab_size),
        target_hidden_size=int(raw.get("target_hidden_size") or base.hidden_size),
        aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
    )


def aux_layer_indices(cfg: Eagle3Config, target_layers: int) -> tuple[int, ...]:
    """Indices for ``LlamaForCausalLM.forward(aux_layers=...)`` (input of layer i), in fc order.

    Config id k means the output of layer k, i.e. the input of layer k + 1 (index
    ``target_layers`` is the last layer's output). Without ids: inputs of 2, L//2, L-3.
    """
    if cfg.aux_layer_ids is not None:
        idx = tuple(k + 1 for k in cfg.aux_layer_ids)
    else:
        idx = (2, target_layers // 2, target_layers - 3)
    if len(idx) != 3 or len(set(idx)) != 3 or not all(0 <= i <= target_layers for i in idx):
        raise ConfigError(
            f"the EAGLE-3 draft needs 3 distinct auxiliary hidden states, but a target with "
            f"{target_layers} layers gives layer inputs {list(idx)}; use a target with at least "
            "7 layers or a draft whose config sets eagle_aux_hidden_state_layer_ids",
            DRAFT_FLAG)
    return idx


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, max_position: int) -> None:
        super().__init__()
        base = cfg.base
        self.cfg, self.tp = cfg, tp
        h = base.hidden_size
        self.fc = RowParallelLinear(3 * cfg.target_hidden_size, h, False, tp, dtype, device)
        # q/k/v read 2H: build the Llama attention on a config whose hidden size is 2H and
        # give it an o_proj back to H.
        wide = dataclasses.replace(base, hidden_size=2 * h)
        self.self_attn = Attention(wide, tp, dtype, device)
        self.self_attn.o_proj = RowParallelLinear(base.num_heads * base.head_dim, h, base.o_bias,
                                                  tp, dtype, device)
        self.mlp = MLP(base, tp, dtype, device)
        eps = base.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps, dtype, device)
        self.input_layernorm = RMSNorm(h, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.norm = RMSNorm(h, eps, dtype, device)
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, h, tp, dtype, device)
        self.rotary = RotaryEmbedding(base.rope, base.head_dim, max_position, device)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long,
                                                device=device), persistent=False)
        self.attention: AttentionBackend = create_attention(
            "auto", self.self_attn.attention_spec(dtype, None), device)
        self.refresh_blocks()

    def set_attention_backend(self, name: str) -> None:
        weight = self.fc.weight
        self.attention = create_attention(
            name, self.self_attn.attention_spec(weight.dtype, None), weight.device)
        self.refresh_blocks()

    def refresh_blocks(self) -> None:
        """The midlayer as native calls where they apply (``fused_decoder.DraftBlocks``)."""
        self.blocks, self.blocks_reason = DraftBlocks.of(self)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated target features [N, 3*Ht] -> [N, H] (row-parallel)."""
        local = self.fc.in_local
        start = self.tp.rank * local
        return self.fc(aux[:, start : start + local])

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                cache: KVPair) -> torch.Tensor:
        """embeds, hidden: [N, H] -> pre-norm output [N, H] (fed back as the next feature)."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        rotary = self.rotary.at(batch.positions, x.dtype)
        if self.blocks is not None and DecoderStack.fits(x):
            meta = self.attention.prepare(batch.attn).meta
            return self.blocks.run(x, hidden, rotary.cos, rotary.sin, meta, cache)
        delta = self.self_attn(x, rotary, bind(self.attention, batch.attn), cache)
        h, normed = self.post_attention_layernorm.add_forward(hidden, delta)
        return h + self.mlp(normed)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full draft-vocab logits (float32, identical on every rank)."""
        return self.lm_head(self.norm(hidden))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def checkpoint_names(self) -> dict[str, tuple[str, int | None]]:
        names: dict[str, tuple[str, int | None]] = {}
        for name, _ in self.named_parameters():
            if name.startswith("rotary"):
                continue
            if name.startswith("self_attn.qkv_proj."):
                for shard, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    names["midlayer." + name.replace("qkv_proj", proj)] = (name, shard)
            elif name.startswith("mlp.gate_up_proj."):
                for shard, proj in enumerate(("gate_proj", "up_proj")):
                    names["midlayer." + name.replace("gate_up_proj", proj)] = (name, shard)
            elif name.startswith(("self_attn.", "mlp.", "hidden_norm", "input_layernorm",
                                  "post_attention")):
                names["midlayer." + name] = (name, None)
            else:
                names[name] = (name, None)
        return names


def build_eagle3(path: str | Path, cfg: Eagle3Config, tp: TPContext, dtype: torch.dtype,
                 device: torch.device, max_position: int) -> Eagle3Draft:
    draft = Eagle3Draft(cfg, tp, dtype, device, max_position)
    load_weights(draft, path, draft.checkpoint_names())
    d2t = _read_tensor(path, "d2t")
    if d2t is not None:
        if d2t.numel() != cfg.draft_vocab_size:
            raise ModelConfigError(f"draft d2t has {d2t.numel()} entries, expected "
                                   f"draft_vocab_size {cfg.draft_vocab_size}", DRAFT_FLAG)
        draft.d2t.copy_(d2t.long())
    elif cfg.draft_vocab_size != cfg.base.vocab_size:
        raise ModelConfigError("draft vocabulary differs from the target's but d2t is missing",
                               DRAFT_FLAG)
    return draft.eval()


def _read_tensor(path: str | Path, name: str) -> torch.Tensor | None:
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    return None
