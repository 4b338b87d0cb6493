"""The MoE and MLA building blocks against transformers' modules, in-process (no spawning).

- routing (DeepSeek grouped sigmoid + correction bias, Qwen3-MoE softmax, Mixtral) picks the
  same experts with the same weights as transformers' routers;
- the MoE layer equals transformers' DeepseekV3MoE; the per-rank partial sums of a TP-split
  and of an expert-parallel layer add up to it (what the one allreduce computes); the
  static (capturable) expert path equals the sorted one;
- yarn frequencies, cos/sin scale and softmax scale, and the interleaved rope, equal
  transformers'; bad --ep-size values are refused.
"""

from __future__ import annotations

import pytest
import torch

from tpserve.errors import ConfigError
from tpserve.layers.moe import SparseMoE
from tpserve.layers.quant import DenseWeights
from tpserve.layers.rotary import RotaryEmbedding, inverse_frequencies, softmax_mscale
from tpserve.layers.router import Router
from tpserve.layers.tp import NoComm, TPContext
from tpserve.models.config import parse_config

H = 32


def hf_config(family: str, **kw):  # type: ignore[no-untyped-def]
    import transformers

    from tests.moe_checkpoints import FAMILIES

    cls, _, shape = FAMILIES[family]
    return getattr(transformers, cls)(**{**shape, "hidden_size": H, **kw}, vocab_size=64,
                                      max_position_embeddings=256)


def ours(hf_cfg, **changes):  # type: ignore[no-untyped-def]
    raw = {**hf_cfg.to_dict(), **changes}
    raw["architectures"] = [type(hf_cfg).__name__.replace("Config", "ForCausalLM")]
    return parse_config(raw)


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("family,changes", [
    ("deepseek", {}), ("deepseek", {"norm_topk_prob": False}), ("kimi", {}),
    ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False}), ("mixtral", {})])
def test_router_matches_hf(family: str, changes: dict) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf_cls = {"deepseek": DeepseekV3TopkRouter, "kimi": DeepseekV3TopkRouter,
              "qwen3_moe": Qwen3MoeTopKRouter, "mixtral": MixtralTopKRouter}[family]
    cfg = hf_config(family, **changes)
    torch.manual_seed(0)
    hf = hf_cls(cfg)
    router = Router(H, ours(cfg).moe, torch.device("cpu"))
    with torch.no_grad():
        hf.weight.normal_(0, 0.3)
        router.weight.copy_(hf.weight)
        if router.e_score_correction_bias is not None:
            hf.e_score_correction_bias.normal_(0, 0.2)
            router.e_score_correction_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(64, H)
        _, ref_w, ref_ids = hf(x)
        got_w, got_ids = router(x)
    ref_w, ref_ids = _sorted(ref_w, ref_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w.float(), rtol=1e-6, atol=1e-7)


def test_correction_bias_changes_selection_not_weights() -> None:
    cfg = ours(hf_config("deepseek", n_group=1, topk_group=1)).moe
    router = Router(H, cfg, torch.device("cpu"))
    torch.manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        x = torch.randn(16, H)
        w0, ids0 = router(x)
        router.e_score_correction_bias[3] = 10.0  # expert 3 always selected
        w1, ids1 = router(x)
    assert (ids1 == 3).any(-1).all() and not (ids0 == 3).any(-1).all()
    sig = torch.sigmoid(x @ router.weight.t())
    # The weight is the unbiased score, renormalised over the chosen experts, then scaled.
    expected = sig[:, 3] / sig.gather(1, ids1).sum(-1) * cfg.routed_scaling_factor
    torch.testing.assert_close(w1[ids1 == 3], expected)


def _load_from_hf(moe: SparseMoE, hf) -> None:  # type: ignore[no-untyped-def]
    """Feed a transformers DeepseekV3MoE's weights through our checkpoint loaders."""
    experts, inter = hf.experts, hf.experts.intermediate_dim
    stack = moe.experts
    for e in range(experts.num_experts):
        parts = (experts.gate_up_proj[e, :inter], experts.gate_up_proj[e, inter:],
                 experts.down_proj[e])
        for kind, t in enumerate(parts):
            param = stack.w13 if kind < 2 else stack.w2
            stack.load_expert(param, t.detach(), 3 * e + kind)
    moe.gate.weight.data.copy_(hf.gate.weight)
    moe.gate.e_score_correction_bias.data.copy_(hf.gate.e_score_correction_bias)
    shared = moe.shared_experts
    for shard, name in enumerate(("gate_proj", "up_proj")):
        layer = shared.gate_up_proj
        layer.load_shard(layer.weight, getattr(hf.shared_experts, name).weight.detach(), shard)
    shared.down_proj.load_weight(shared.down_proj.weight,
                                 hf.shared_experts.down_proj.weight.detach())


def _moe(cfg, rank: int = 0, size: int = 1, ep: int = 1) -> SparseMoE:  # type: ignore[no-untyped-def]
    tp = TPContext(rank, size, NoComm(), ep_size=ep)
    return SparseMoE("mlp.", H, ours(cfg).moe, DenseWeights(), tp, torch.float32,
                     torch.device("cpu"))


def test_moe_layer_partials_sum_to_hf() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = hf_config("deepseek")
    torch.manual_seed(2)
    hf = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.2)
        x = torch.randn(24, H)
        ref = hf(x[None])[0]
        full = _moe(cfg)
        _load_from_hf(full, hf)
        torch.testing.assert_close(full(x), ref, rtol=1e-5, atol=1e-5)
        w, ids = full.gate(x)
        torch.testing.assert_close(full.experts.forward_static(x, w, ids),
                                   full.experts.forward_sorted(x, w, ids), rtol=1e-5, atol=1e-6)
        for size, ep in ((2, 1), (4, 1), (2, 2), (4, 4)):
            total = torch.zeros_like(ref)
            for rank in range(size):
                part = _moe(cfg, rank, size, ep)
                _load_from_hf(part, hf)
                total += part(x)  # NoComm: the rank's partial sum, which the allreduce adds
            torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5, msg=f"{size} {ep}")


@pytest.mark.parametrize("size,ep", [(1, 1), (4, 4)])
def test_sorted_and_static_combine_bit_for_bit(size: int, ep: int) -> None:
    """Both paths add a token's experts in ascending expert order in float32: with a row-wise
    expert function (so the matmul's row count cannot matter) the bf16 outputs are equal bit
    for bit, which is what lets CUDA-graph decoding repeat the eager path's greedy tokens."""
    cfg = hf_config("deepseek")
    torch.manual_seed(5)
    x = torch.randn(37, H).bfloat16()
    ids = torch.stack([torch.randperm(cfg.n_routed_experts)[: cfg.num_experts_per_tok]
                       for _ in range(37)])
    w = torch.rand(37, cfg.num_experts_per_tok)
    for rank in range(size):
        stack = _moe(cfg, rank, size, ep).experts
        stack.expert_mlp = lambda e, rows: torch.tanh(rows * (0.3 + e)) * (e % 3 - 1.1)
        static, dyn = stack.forward_static(x, w, ids), stack.forward_sorted(x, w, ids)
        assert dyn.dtype == torch.bfloat16 and dyn.abs().sum() > 0
        assert torch.equal(static, dyn), (rank, (static.float() - dyn.float()).abs().max())


def test_ep_size_refusals() -> None:
    cfg = hf_config("deepseek")
    with pytest.raises(ConfigError) as err:
        _moe(cfg, 0, 4, ep=2)
    assert err.value.flag == "--ep-size"
    with pytest.raises(ConfigError, match="evenly"):
        _moe(hf_config("deepseek", n_routed_experts=6, n_group=2), 0, 4, ep=4)


@pytest.mark.parametrize("mscales", [(1.0, 1.0), (1.0, 0.8), (0.707, 0.707)])
def test_yarn_matches_hf(mscales: tuple[float, float]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from tests.moe_checkpoints import YARN

    rope = {**YARN, "mscale": mscales[0], "mscale_all_dim": mscales[1], "factor": 40.0}
    cfg = hf_config("deepseek", rope_parameters=rope)
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    mine = ours(cfg)
    torch.testing.assert_close(inverse_frequencies(mine.rope, mine.mla.qk_rope_head_dim), inv)
    emb = RotaryEmbedding(mine.rope, mine.mla.qk_rope_head_dim, 8, torch.device("cpu"))
    freqs = torch.outer(torch.arange(8.0), inv)
    torch.testing.assert_close(emb.cos[:, : inv.numel()], freqs.cos() * factor)
    scale = mine.mla.qk_head_dim**-0.5 * softmax_mscale(mine.rope)
    assert scale == pytest.approx(DeepseekV3Attention(cfg, 0).scaling, rel=1e-12)


def test_interleaved_rope_matches_hf() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    cfg = ours(hf_config("deepseek"))
    dim = cfg.mla.qk_rope_head_dim
    emb = RotaryEmbedding(cfg.rope, dim, 64, torch.device("cpu"), interleaved=True)
    pos = torch.tensor([0, 3, 17, 63])
    q, k = torch.randn(4, 2, dim), torch.randn(4, 1, dim)
    got_q, got_k = emb(pos, q, k)
    cos, sin = emb.cos[pos], emb.sin[pos]
    ref_q, ref_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                   cos[None], sin[None])
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1))


def test_family_config_parsing() -> None:
    base = hf_config("deepseek").to_dict()
    alternate = parse_config({**base, "architectures": None, "model_type": "kimi_k2",
                              "moe_layer_freq": 2, "first_k_dense_replace": 1})
    assert alternate.architecture == "DeepseekV3ForCausalLM"
    assert alternate.moe.moe_layers == (2,)  # 3 layers: 0 dense (first_k), 1 dense (freq 2)
    with pytest.raises(ValueError, match="topk_method"):
        parse_config({**base, "architectures": ["DeepseekV3ForCausalLM"],
                      "topk_method": "group_limited_greedy"})
    qwen = ours(hf_config("qwen3_moe"))
    assert qwen.qk_norm and qwen.moe.moe_layers == (0, 2) and qwen.moe.scoring == "softmax"
