"""MLA specifics: the latent KV cache's size, the expanded prefill path, MTP layers skipped.

- ``kv_cache_bytes_per_token`` = layers x (kv_lora_rank + qk_rope_head_dim) x dtype size, the
  engine allocates one [slots, 1, latent] tensor per layer, and the same budget holds
  (uncompressed K/V bytes / latent bytes) times more tokens than an expanded cache would;
- the expanded attention (per-head K/V from the latents) gives transformers' logits and
  greedy tokens like the absorbed one;
- a checkpoint with a multi-token-prediction layer loads without reading it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import build_engine, make_request, run_all
from tests.moe_checkpoints import add_mtp_layer, make_moe_checkpoint
from tests.test_model_vs_hf import assert_close, prefill_logits
from tests.test_moe_vs_hf import GREEDY, PROMPTS, hf_reference
from tpserve.args import ServerArgs
from tpserve.engine.build import build_engine as build_rank
from tpserve.engine.kv_cache import KVLayout
from tpserve.layers.tp import TPContext
from tpserve.loader import iter_slices, safetensors_files
from tpserve.models.config import load_config
from tpserve.models.registry import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_moe_checkpoint(tmp_path_factory.mktemp("mla") / "ds", "deepseek")
    add_mtp_layer(path)
    return path


def test_latent_cache_size_and_capacity(ckpt: Path) -> None:
    cfg = load_config(ckpt)
    mla, dtype = cfg.mla, torch.bfloat16
    model = build_model(ckpt, TPContext.single(), dtype, torch.device("cpu"), 128)
    layout = model.kv_layout()
    latent = mla.kv_lora_rank + mla.qk_rope_head_dim
    assert layout.bytes_per_token(dtype) == cfg.num_layers * latent * 2
    args = ServerArgs(model=str(ckpt), device="cpu", dtype="bfloat16", allreduce="gloo",
                      kv_cache_gb=1 / 1024, page_size=4, context_length=64, cpu_threads=1)
    kv = build_rank(args).runner.kv
    assert kv.cfg.bytes_per_token == layout.bytes_per_token(dtype)  # kv_cache_bytes_per_token
    assert kv.cfg.num_pages == (1 << 20) // (kv.cfg.bytes_per_token * 4)  # the whole 1 MiB
    assert kv.layers[0][0].shape == (kv.cfg.num_pages * 4, 1, latent) and len(kv.layers[0]) == 1
    # The same attention with per-head K (192-wide in DeepSeek-V3) and V cached.
    expanded = KVLayout(cfg.num_layers, ((cfg.num_heads, mla.qk_head_dim),
                                         (cfg.num_heads, mla.v_head_dim)))
    expanded_pages = (1 << 20) // (expanded.bytes_per_token(dtype) * 4)
    ratio = expanded.bytes_per_token(dtype) / layout.bytes_per_token(dtype)
    assert ratio > 3 and kv.cfg.num_pages >= int(expanded_pages * ratio) - 1


def test_expanded_prefill_matches_hf(ckpt: Path) -> None:
    logits, greedy = hf_reference(ckpt)
    engine = build_engine(ckpt)
    for layer in engine.runner.model.layers:
        layer.self_attn.expand_min_queries = 2  # every multi-token step expands
    for ids, ref in zip(PROMPTS, logits):
        assert_close(prefill_logits(engine.runner, ids), ref, "expanded MLA")
    outs = run_all(engine, [make_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    assert outs == greedy


def test_mtp_layer_is_not_loaded(ckpt: Path) -> None:
    present = [n for n, _ in iter_slices(safetensors_files(ckpt)) if n.startswith("model.layers.3.")]
    assert "model.layers.3.eh_proj.weight" in present  # the checkpoint does carry one
    model = build_model(ckpt, TPContext.single(), torch.float32, torch.device("cpu"), 64)
    names = model.checkpoint_names()
    assert not any(n.startswith("model.layers.3.") for n in names)
    assert all(model.ignored_checkpoint_tensor(n) for n in present)
    assert not model.ignored_checkpoint_tensor("model.layers.2.mlp.gate.weight")


def test_build_model_chooses_the_requested_attention_once(ckpt: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` probes FlashInfer's MLA kernel on a GPU (a JIT compile and a self-check): the
    model starts on ``mla`` and ``build_model`` chooses what was asked for, once."""
    import tpserve.models.deepseek_v3 as ds

    asked: list[str] = []
    real = ds.choose_mla_backend

    def counting(requested: str, *args: object) -> object:
        asked.append(requested)
        return real(requested, *args)

    monkeypatch.setattr(ds, "choose_mla_backend", counting)
    build_model(ckpt, TPContext.single(), torch.float32, torch.device("cpu"), 64)
    assert asked == ["mla", "auto"]
    asked.clear()
    build_model(ckpt, TPContext.single(), torch.float32, torch.device("cpu"), 64,
                attention="torch")
    assert asked == ["mla", "torch"]
