"""Start-up refusals: checked before loading, one line, exit code 2, no traceback.

The TP verdict is checked against the model code itself: a TP size is refused exactly when
building the sharded model for some rank fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tpserve.args import ServerArgs
from tpserve.demo import demo_target
from tpserve.errors import ConfigError
from tpserve.layers.tp import NoComm, TPContext
from tpserve.models.config import SUPPORTED_ARCHITECTURES, load_config, parse_config
from tpserve.models.llama import LlamaForCausalLM
from tpserve.preflight import (
    check_before_loading,
    check_server_args,
    check_tp_split,
    tp_problems,
    working_tp_sizes,
)

SHAPES = [  # (heads, kv heads, intermediate): SmolLM2-135M's 9/3/1536 among them
    (9, 3, 1536), (8, 8, 96), (8, 2, 96), (12, 4, 100), (6, 1, 60), (4, 4, 30),
]


def _cfg(heads: int, kv: int, inter: int, vocab: int = 97):
    return parse_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8 * heads,
                         "head_dim": 8, "intermediate_size": inter, "num_hidden_layers": 1,
                         "num_attention_heads": heads, "num_key_value_heads": kv,
                         "vocab_size": vocab})


def _builds(cfg, tp: int) -> bool:  # type: ignore[no-untyped-def]
    try:
        for rank in range(tp):
            LlamaForCausalLM(cfg, TPContext(rank, tp, NoComm()), torch.float32,
                             torch.device("cpu"), 16)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("shape", SHAPES)
def test_tp_verdict_matches_the_model_code(shape: tuple[int, int, int]) -> None:
    cfg = _cfg(*shape)
    for tp in range(1, 13):
        assert (not tp_problems(cfg, tp)) == _builds(cfg, tp), (shape, tp, tp_problems(cfg, tp))


def test_tp_refusal_names_value_tp_and_alternatives() -> None:
    cfg = _cfg(9, 3, 1536)
    assert working_tp_sizes(cfg, 16) == [1, 3]  # TP 9 splits the heads, not 1536
    with pytest.raises(ConfigError) as err:
        check_tp_split(cfg, 2)
    msg = str(err.value)
    assert "num_attention_heads (9)" in msg and "tensor-parallel size 2" in msg
    assert "TP sizes that work for this model: 1, 3" in msg and "\n" not in msg
    assert err.value.flag == "--nproc-per-node"
    with pytest.raises(ConfigError, match=r"intermediate_size \(100\) .* size 8"):
        check_tp_split(_cfg(8, 8, 100), 8)
    with pytest.raises(ConfigError, match=r"not a multiple of num_key_value_heads \(3\)"):
        check_tp_split(_cfg(12, 3, 96), 4)


def test_vocab_never_refuses() -> None:
    cfg = _cfg(4, 4, 32, vocab=97)  # prime vocab: padded per rank, not split exactly
    assert not tp_problems(cfg, 4) and _builds(cfg, 4)


def test_architecture_and_quantization(tmp_path: Path) -> None:
    raw = {"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}
    with pytest.raises(ConfigError, match="'GPT2LMHeadModel' is not served") as err:
        parse_config(raw)
    assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)
    cfg = _cfg(4, 4, 32)
    quant = dataclasses.replace(cfg, raw={**cfg.raw, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ConfigError, match="quant_method 'awq' is not read by tpserve"):
        check_before_loading(quant, 1, tmp_path)


def test_missing_files_are_named(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m", shards=2, hidden=32, heads=2, kv_heads=2,
                           intermediate=64)
    cfg = load_config(ckpt)
    check_before_loading(cfg, 1, ckpt)  # no tokenizer dir: offline use, weights only
    with pytest.raises(ConfigError, match=f"missing tokenizer file {ckpt / 'tokenizer.json'}"):
        check_before_loading(cfg, 1, ckpt, ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"missing weight file {shard}"):
        check_before_loading(cfg, 1, ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="found pytorch_model.bin: tpserve reads safetensors"):
        check_before_loading(cfg, 1, empty)
    with pytest.raises(ConfigError, match=f"missing model config {empty / 'config.json'}"):
        load_config(empty)


def test_bad_flags_refused_before_loading(tmp_path: Path) -> None:
    demo = demo_target()
    cfg = load_config(demo)
    with pytest.raises(ConfigError, match="--chat-template 'x' is neither"):
        check_before_loading(cfg, 1, demo, demo, chat_template="x")
    with pytest.raises(ConfigError, match="missing generation_config.json"):
        check_before_loading(cfg, 1, demo, demo, generation_config=str(tmp_path))
    with pytest.raises(ConfigError, match="unknown --tool-call-parser 'qwen'"):
        check_server_args(ServerArgs(tool_call_parser="qwen"), 1)
    check_server_args(ServerArgs(tool_call_parser="hermes"), 1)


def _run_rank(args: list[str], tmp_path: Path, world: int) -> subprocess.CompletedProcess:
    """One rank as torchrun starts it: a bad launch must end before the rendezvous."""
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
           "TPSERVE_CACHE": str(tmp_path)}
    from tests.harness import free_port

    return subprocess.run([sys.executable, "-m", "tpserve", "--device", "cpu", "--port",
                           str(free_port()), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_process_exits_2_with_one_line(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m", hidden=48, heads=3, kv_heads=3, intermediate=96)
    (ckpt / "tokenizer.json").write_text((demo_target() / "tokenizer.json").read_text())
    out = _run_rank(["--model", str(ckpt)], tmp_path, world=2)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: num_attention_heads (3) is not divisible by the tensor-parallel "
                      "size 2; TP sizes that work for this model: 1, 3 (torchrun "
                      "--nproc-per-node N)"], out.stderr
    assert "Traceback" not in out.stderr and "loading weights" not in out.stderr
    out = _run_rank(["--model", str(tmp_path / "nowhere")], tmp_path, world=1)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: model directory '{tmp_path / 'nowhere'}' does not exist" in out.stderr
    (ckpt / "config.json").write_text(json.dumps({**json.loads((ckpt / "config.json").read_text()),
                                                  "architectures": ["MambaForCausalLM"]}))
    out = _run_rank(["--model", str(ckpt)], tmp_path, world=1)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: architecture 'MambaForCausalLM' is not served by tpserve" in out.stderr
