"""The EAGLE-3 draft against an independent reference written from the format description,
and the start-up errors for bad speculative settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tpserve.args import ServerArgs
from tpserve.engine.kv_cache import KVCache, KVCacheConfig
from tpserve.engine.plan import Layout, build_forward_batch
from tpserve.errors import ConfigError
from tpserve.layers.tp import TPContext
from tpserve.models.config import load_config
from tpserve.models.eagle3 import aux_layer_indices, build_eagle3, load_eagle3_config
from tpserve.spec.config import check_draft_matches, spec_config_from_args


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(t).float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference(w: dict[str, torch.Tensor], embeds: torch.Tensor, aux: torch.Tensor,
              heads: int = 4, kv_heads: int = 2) -> torch.Tensor:
    """Draft logits for every row of one causal sequence, straight from the format."""
    m = "midlayer."
    hid = aux @ w["fc.weight"].T
    x = torch.cat([_rms(embeds, w[m + "input_layernorm.weight"]),
                   _rms(hid, w[m + "hidden_norm.weight"])], -1)
    t, d = x.shape[0], hid.shape[1] // heads
    q = _rope((x @ w[m + "self_attn.q_proj.weight"].T).view(t, heads, d))
    k = _rope((x @ w[m + "self_attn.k_proj.weight"].T).view(t, kv_heads, d))
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, kv_heads, d)
    k, v = (z.repeat_interleave(heads // kv_heads, 1) for z in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    h = hid + att @ w[m + "self_attn.o_proj.weight"].T
    y = _rms(h, w[m + "post_attention_layernorm.weight"])
    mlp = F.silu(y @ w[m + "mlp.gate_proj.weight"].T) * (y @ w[m + "mlp.up_proj.weight"].T)
    h = h + mlp @ w[m + "mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("arch", ["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"])
def test_draft_logits_match_reference(tmp_path: Path, arch: str) -> None:
    target = make_checkpoint(tmp_path / "t", "llama", layers=4, vocab=40)
    ids = [0, 2, 3, 7, 11, 19, 23, 31, 39]
    draft_dir = make_draft(tmp_path / "d", target, aux_ids=(0, 1, 3), draft_ids=ids, arch=arch)
    hf = transformers.LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 8, 12, 30]])
    with torch.no_grad():
        states = hf(tokens, output_hidden_states=True).hidden_states  # [i] = input of layer i
    cfg = load_eagle3_config(draft_dir)
    aux_idx = aux_layer_indices(cfg, 4)
    assert aux_idx == (1, 2, 4)
    aux = torch.cat([states[1][0], states[2][0], _last_output(hf, tokens)], -1)
    draft = build_eagle3(draft_dir, cfg, TPContext.single(), torch.float32,
                         torch.device("cpu"), 64)
    kv = KVCache(KVCacheConfig.gqa(8, 4, 1, 2, 16, torch.float32), torch.device("cpu"))
    t = tokens.shape[1]
    plan = Layout(token_ids=tokens.numpy(), q_lens=np.array([t]),
                    cached_lens=np.array([0]), page_table=np.array([[1, 2, 3]]))
    fb = build_forward_batch(plan, 4, None, torch.device("cpu"))
    embeds = hf.model.embed_tokens(tokens[0]).detach()
    with torch.no_grad():
        ours = draft.logits(draft(embeds, draft.project(aux), fb, kv.layers[0]))
    ref = reference(load_file(str(draft_dir / "model.safetensors")), embeds, aux)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    draft_ids = torch.arange(len(ids))
    assert draft.to_target(draft_ids).tolist() == ids


def _last_output(hf: transformers.LlamaForCausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """Output of the last layer before the final norm (HF's last hidden state is normed)."""
    captured: list[torch.Tensor] = []
    hook = hf.model.layers[-1].register_forward_hook(
        lambda mod, inp, out: captured.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        hf(tokens)
    hook.remove()
    return captured[0].reshape(tokens.shape[1], -1)


def _args(**kw: object) -> ServerArgs:
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x")
    return ServerArgs(**{**spec, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(speculative_draft_model_path=None), "needs --speculative-draft-model-path"),
    (dict(speculative_algorithm="MEDUSA"), "not supported"),
    (dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=6),
     "chain"),
    (dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=8),
     "exceeds"),
    (dict(speculative_num_steps=0), ">= 1"),
])
def test_bad_flags(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec_config_from_args(_args(**kw))


def test_good_flags_and_off() -> None:
    assert spec_config_from_args(ServerArgs()) is None
    cfg = spec_config_from_args(_args(speculative_num_steps=3, speculative_eagle_topk=4,
                                      speculative_num_draft_tokens=16))
    assert cfg is not None and cfg.num_candidates == 4 + 2 * 16


def test_draft_mismatch_and_too_few_layers(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "t", "llama", layers=4, vocab=40)
    tcfg = load_config(target)
    wide = load_eagle3_config(make_draft(tmp_path / "w", target, target_hidden=128))
    with pytest.raises(ConfigError, match="target hidden size 128"):
        check_draft_matches(wide, tcfg)
    plain = load_eagle3_config(make_draft(tmp_path / "p", target, aux_ids=None))
    with pytest.raises(ConfigError, match="3 distinct auxiliary"):
        aux_layer_indices(plain, tcfg.num_layers)
    assert aux_layer_indices(dataclasses.replace(plain), 8) == (2, 4, 5)
