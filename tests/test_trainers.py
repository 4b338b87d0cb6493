"""The training tools on tiny configurations: the target and draft trainers run, their
losses fall, exports reload in tpserve, and the trainer's draft math is the engine's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tests.checkpoints import make_checkpoint
from tpserve.engine.kv_cache import KVCache, KVCacheConfig
from tpserve.engine.plan import Layout, build_forward_batch
from tpserve.errors import ConfigError
from tpserve.layers.tp import TPContext
from tpserve.models.eagle3 import build_eagle3, load_eagle3_config
from tpserve.spec.config import SpecConfig
from tpserve.spec.eagle import draft_tree
from tpserve.train import eagle3, evaluate, target
from tpserve.train.draft_model import DraftShape, Eagle3Trainable
from tpserve.train.eagle_data import DraftVocab, target_view
from tpserve.train.eagle_export import default_aux_ids, export_draft, load_exported


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("train") / "target"
    cfg = target.TargetConfig(vocab_size=384, hidden_size=64, num_layers=4,
                              intermediate_size=128, seq_len=32, batch_size=8, steps=12,
                              minutes=None, eval_every=6, val_windows=4, max_files=12,
                              threads=1, lr=3e-3)
    return out, target.train(cfg, out)


def test_target_trainer(tiny_target: tuple[Path, dict]) -> None:
    out, log = tiny_target
    val = json.loads((out / "train_log.json").read_text())["curves"]["val"]
    assert val[-1][1] < val[0][1] and log["steps"] == 12
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # a normal HF directory
    assert model.config.architectures == ["LlamaForCausalLM"]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "loss.png"):
        assert (out / name).is_file()


def test_eagle3_trainer(tiny_target: tuple[Path, dict], tmp_path: Path) -> None:
    cfg = eagle3.DraftTrainConfig(draft_vocab=128, prompts=8, new_tokens=16, gen_batch=8,
                                  batch_size=4, steps=12, minutes=None, lr=1e-2,
                                  eval_prompts=1, eval_tokens=8, threads=1, device="cpu",
                                  aux_layers="2,0,1")
    log = eagle3.train(cfg, tiny_target[0], tmp_path / "draft")
    curve = json.loads((tmp_path / "draft" / "train_log.json").read_text())["curves"]["step 0"]
    assert curve[-1][1] < curve[0][1]
    saved = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLMEagle3"] and saved["draft_vocab_size"] == 128
    # the chosen layers, in the order given: the engine concatenates features that way
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 0, 1]
    assert log["aux_layer_ids"] == [2, 0, 1]
    assert log["eval"]["accept_length"] >= 1.0  # tpserve loaded it and decoded speculatively


@pytest.mark.parametrize("spec", ["1,2", "1,3,3", "0,1,7", "a,b,c", "-1,0,1"])
def test_aux_layers_refuses_what_the_engine_cannot_capture(spec: str) -> None:
    with pytest.raises(ConfigError, match="--aux-layers"):
        eagle3.aux_layer_ids(spec, 8)


def test_aux_layers_default_and_choice() -> None:
    assert eagle3.aux_layer_ids("", 8) == default_aux_ids(8) == (1, 3, 4)
    assert eagle3.aux_layer_ids("1,3,6", 8) == (1, 3, 6)


def _random_draft(shape: DraftShape) -> Eagle3Trainable:
    torch.manual_seed(3)
    draft = Eagle3Trainable(shape)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    return draft


def test_trainer_draft_matches_engine_draft(tmp_path: Path) -> None:
    tdir = make_checkpoint(tmp_path / "t", "llama", layers=4, hidden=64, heads=4, kv_heads=2,
                           vocab=48)
    tcfg = json.loads((tdir / "config.json").read_text())
    hf = transformers.LlamaForCausalLM.from_pretrained(tdir, dtype=torch.float32)
    vocab = DraftVocab(torch.arange(0, 48, 2))
    shape = DraftShape(64, 4, 2, 96, 24, 64, tcfg["rms_norm_eps"], 10000.0)
    draft, aux = _random_draft(shape), default_aux_ids(4)
    export_draft(draft, vocab, aux, tcfg, tmp_path / "d", dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 9, 2, 33, 17, 4, 8, 12, 30]])
    rows = tokens.shape[1] - 1
    feats, _, _ = target_view(hf, tokens, aux, vocab.ids)
    engine_draft = build_eagle3(tmp_path / "d", load_eagle3_config(tmp_path / "d"),
                                TPContext.single(), torch.float32, torch.device("cpu"), 64)
    kv = KVCache(KVCacheConfig.gqa(8, 4, 1, 2, 16, torch.float32), torch.device("cpu"))
    pages = np.array([[1, 2, 3, 4]])
    plan = Layout(token_ids=tokens[0, 1:].numpy(), q_lens=np.array([rows]),
                  cached_lens=np.array([0]), page_table=pages)
    fb = build_forward_batch(plan, 4, torch.device("cpu"))
    embed = torch.nn.Embedding.from_pretrained(hf.get_input_embeddings().weight)
    with torch.no_grad():
        out = engine_draft(embed(tokens[0, 1:]), engine_draft.project(feats[0, :rows]), fb,
                           kv.layers[0])
        tree = draft_tree(engine_draft, embed, kv.layers[0], out[-1:], tokens[:, -1],
                          torch.from_numpy(pages), torch.tensor([rows]), SpecConfig(3, 1, 4), 4)
        chain = tree.tokens[0, 1:]  # the engine's greedy draft chain after the root
        padded = torch.cat([tokens[0], chain])[None]
        embeds = [embed(padded[:, 1 + k : 1 + k + rows]) for k in range(3)]
        logits = draft.unrolled(embeds, feats[:, :rows])
    # Step 0 (the draft extend) over every row, then each unrolled step's proposal.
    torch.testing.assert_close(logits[0][0], engine_draft.logits(out), rtol=1e-4, atol=1e-4)
    trainer_chain = [int(vocab.ids[lg[0, -1].argmax()]) for lg in logits]
    assert trainer_chain == chain.tolist()


def test_warm_start_takes_the_exported_weights_and_vocab(tmp_path: Path) -> None:
    shape = DraftShape(64, 4, 2, 96, 24, 64, 1e-6, 10000.0)
    vocab = DraftVocab(torch.tensor([0, 3, 4, 9, 11, 20, 21, 22] + list(range(30, 46))))
    tcfg = {"vocab_size": 48, "max_position_embeddings": 64}
    trained = _random_draft(shape)
    export_draft(trained, vocab, default_aux_ids(4), tcfg, tmp_path / "d", dtype=torch.float32)
    fresh = Eagle3Trainable(shape)
    got = load_exported(fresh, tmp_path / "d")
    assert torch.equal(got.ids, vocab.ids)
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    with pytest.raises(ConfigError, match="shape"):
        load_exported(Eagle3Trainable(DraftShape(64, 4, 2, 128, 24, 64, 1e-6, 1e4)), tmp_path / "d")


def test_evaluation_measures_the_setting_it_names() -> None:
    """The chooser (on by default with a draft) would report its own mix of settings."""
    args = evaluate.engine_args(Path("target"), Path("draft"), evaluate.SpecSetting(3, 1, 4), "cpu")
    assert args.speculative_adaptive == "off"
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (3, 1, 4)
