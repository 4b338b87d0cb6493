"""A real published checkpoint (SmolLM2-135M-Instruct, see tests/real_checkpoints.py) served
as a user would, against transformers on the same files:

- greedy ``/generate`` equals transformers' greedy at TP = 1 and TP = 3 (9 heads, 3 KV heads);
- a chat completion's prompt tokens and greedy reply equal ``apply_chat_template`` + greedy
  (the model's own ``chat_template.jinja``: 37 prompt tokens, "The capital of France is Paris.");
- multi-byte text (Japanese split over byte-level tokens) streams whole characters, in SSE
  ``/generate`` and OpenAI chat streams alike;
- ``--model ORG/NAME`` resolves in a local Hugging Face cache and names the served model;
- TP = 2 is refused before loading, one line per rank, exit code 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import free_port
from tests.real_checkpoints import smollm2_dir
from tests.server_proc import running_server

pytestmark = pytest.mark.slow
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
FLAGS = ("--device", "cpu", "--dtype", "float32", "--allreduce", "gloo", "--context-length",
         "256", "--kv-cache-gb", "0.05", "--max-running-requests", "4",
         "--skip-server-warmup")
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
JAPANESE = [{"role": "user", "content": "Translate 'thank you' into Japanese. "
                                        "Answer with the Japanese only."}]
CODE = "def fib(n):"
CODE_TOKENS, JAPANESE_TOKENS = 10, 12


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return smollm2_dir()


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> dict[str, Any]:
    """transformers' tokens and greedy outputs for every prompt the tests send."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def greedy(ids: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                 dtype=torch.long), max_new_tokens=n, do_sample=False)
        return out[0, len(ids):].tolist()

    def chat_ids(messages: list[dict[str, str]]) -> list[int]:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                            return_dict=True)["input_ids"])

    ref: dict[str, Any] = {"code_ids": tok(CODE)["input_ids"], "france": chat_ids(FRANCE),
                           "japanese": chat_ids(JAPANESE), "tok": tok}
    ref["code_out"] = greedy(ref["code_ids"], CODE_TOKENS)
    ref["france_out"] = greedy(ref["france"], 16)
    ref["japanese_out"] = greedy(ref["japanese"], JAPANESE_TOKENS)
    return ref


def hf_cache(model_dir: Path, root: Path) -> Path:
    """``model_dir`` laid out as huggingface_hub caches REPO (snapshot symlinks, refs/main)."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snap / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return root


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("srv1")
    env = {"HF_HUB_CACHE": str(hf_cache(model_dir, cache / "hub"))}
    with running_server(1, "--model", REPO, *FLAGS, cache=cache, env=env,
                        timeout=300) as (url, _):
        yield url


def generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_matches_transformers_tp1(server: str, hf: dict[str, Any]) -> None:
    out = generate(server, {"text": CODE, "sampling_params": {
        "max_new_tokens": CODE_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["prompt_tokens"] == len(hf["code_ids"])
    assert out["output_ids"] == hf["code_out"]
    assert out["text"] == hf["tok"].decode(hf["code_out"])


def test_chat_matches_apply_chat_template(server: str, hf: dict[str, Any]) -> None:
    r = httpx.post(server + "/v1/chat/completions", timeout=300, json={
        "model": REPO, "messages": FRANCE, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == REPO  # --model ORG/NAME names the served model
    assert body["usage"]["prompt_tokens"] == len(hf["france"]) == 37
    expected = hf["france_out"]
    assert expected[-1] == hf["tok"].convert_tokens_to_ids("<|im_end|>")  # stopped at EOS
    reply = body["choices"][0]
    assert reply["message"]["content"] == hf["tok"].decode(expected, skip_special_tokens=True)
    assert reply["message"]["content"] == "The capital of France is Paris."
    assert reply["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len(expected)


def test_model_info_and_models(server: str, model_dir: Path) -> None:
    info = httpx.get(server + "/get_model_info", timeout=30).json()
    assert info["chat_template"].endswith("chat_template.jinja")
    assert info["served_model_name"] == REPO and info["eos_token_ids"] == [2]
    models = httpx.get(server + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == [REPO]


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def test_streams_never_break_a_character(server: str, hf: dict[str, Any]) -> None:
    expected = hf["japanese_out"]
    text = hf["tok"].decode(expected)
    assert any(ord(c) > 0x3000 for c in text)  # really Japanese, split over byte tokens
    body = {"input_ids": hf["japanese"], "stream": True,
            "sampling_params": {"max_new_tokens": JAPANESE_TOKENS, "temperature": 0}}
    with httpx.stream("POST", server + "/generate", json=body, timeout=300) as r:
        events = _sse(r)
    assert events[-1]["output_ids"] == expected
    texts = [e["text"] for e in events]
    assert all("\ufffd" not in t for t in texts[:-1])  # only a final flush may hold one
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    chat = {"messages": JAPANESE, "stream": True, "max_tokens": JAPANESE_TOKENS,
            "temperature": 0}
    with httpx.stream("POST", server + "/v1/chat/completions", json=chat, timeout=300) as r:
        deltas = [c["choices"][0]["delta"].get("content") or "" for c in _sse(r) if c["choices"]]
    assert "".join(deltas) == texts[-1]
    assert all("\ufffd" not in d for d in deltas[:-1])


def test_generate_matches_transformers_tp3(model_dir: Path, hf: dict[str, Any],
                                           tmp_path: Path) -> None:
    with running_server(3, "--model", str(model_dir), "--served-model-name", "smol", *FLAGS,
                        cache=tmp_path, timeout=300) as (url, _):
        out = generate(url, {"input_ids": hf["code_ids"], "sampling_params": {
            "max_new_tokens": CODE_TOKENS, "temperature": 0, "ignore_eos": True}})
        assert out["output_ids"] == hf["code_out"]
        info = httpx.get(url + "/get_server_info", timeout=60).json()
        assert info["tp_size"] == 3
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "smol"


def test_tp2_refused_before_loading(model_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "tpserve", "--model", str(model_dir),
           "--port", str(free_port()), *FLAGS]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "TPSERVE_CACHE": str(tmp_path)})
    line = ("error: num_attention_heads (9) is not divisible by the tensor-parallel size 2; "
            "TP sizes that work for this model: 1, 3 (torchrun --nproc-per-node N)")
    lines = (out.stdout + out.stderr).splitlines()
    assert out.returncode != 0
    # Each rank prints the line and exits 2; torchrun stops the job at the first rank to exit,
    # so the other rank's line may never be written. torchrun's own failure report follows.
    assert 1 <= lines.count(line) <= 2, out.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*2 ", out.stderr), out.stderr[-3000:]
    assert not any("loading weights" in x for x in lines)
    assert time.monotonic() - start < 120
