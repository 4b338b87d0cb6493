"""generation_config.json: EOS lists, sampling defaults for what a request leaves out, and the
--generation-config modes; checked through the server's own parameter parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import byte_tokenizer
from tpserve.engine.sampling_params import SamplingParams
from tpserve.errors import ConfigError
from tpserve.generation_config import (
    GenerationDefaults,
    load_generation_config,
    stop_token_ids,
    with_defaults,
)
from tpserve.server.engine_client import ClientLimits, EngineClient

# Llama 3.1 Instruct's file, as published.
LLAMA31 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
           "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"}


def write(directory: Path, cfg: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(cfg))
    return directory


def client_with(defaults: GenerationDefaults, limit: int = 4096) -> EngineClient:
    limits = ClientLimits(vocab_size=1000, context_length=8192, max_new_tokens_limit=limit,
                          max_queued_requests=1, server_seed=0, max_running_requests=1)
    client = EngineClient(None, byte_tokenizer(), frozenset(), limits, {})  # type: ignore[arg-type]
    client.sampling_defaults = defaults.sampling
    return client


def test_llama31_file(tmp_path: Path) -> None:
    gen = load_generation_config(write(tmp_path, LLAMA31))
    assert dict(gen.sampling) == {"temperature": 0.6, "top_p": 0.9}
    assert stop_token_ids((128001,), gen) == {128001, 128008, 128009}
    assert gen.info() == {"generation_config": str(tmp_path / "generation_config.json"),
                          "sampling_defaults": {"temperature": 0.6, "top_p": 0.9},
                          "generation_eos_token_ids": [128001, 128008, 128009]}


def test_defaults_fill_only_what_the_request_leaves_out(tmp_path: Path) -> None:
    cfg = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
           "repetition_penalty": 1.05, "max_new_tokens": 300, "eos_token_id": 5}
    client = client_with(load_generation_config(write(tmp_path, cfg)))
    got = client.parse_params({"temperature": 0.0, "max_new_tokens": 7})
    assert got == SamplingParams(temperature=0.0, max_new_tokens=7, top_p=0.8, top_k=20,
                                 min_p=0.05, repetition_penalty=1.05)
    assert client.parse_params(None) == SamplingParams(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05,
        max_new_tokens=300)
    # an explicit null is "left out"; an inherited max_new_tokens respects the server's cap
    assert client.parse_params({"top_k": None}).top_k == 20
    assert client_with(load_generation_config(tmp_path), limit=100).parse_params({}) \
        .max_new_tokens == 100


def test_ignore_keeps_eos_drops_sampling(tmp_path: Path) -> None:
    gen = load_generation_config(write(tmp_path, LLAMA31), "ignore")
    assert dict(gen.sampling) == {} and gen.eos_token_ids == (128001, 128008, 128009)
    assert client_with(gen).parse_params({}) == SamplingParams()  # tpserve's own defaults


def test_directory_mode_and_errors(tmp_path: Path) -> None:
    write(tmp_path / "model", LLAMA31)
    other = write(tmp_path / "other", {"temperature": 0.2, "top_k": 0})
    gen = load_generation_config(tmp_path / "model", str(other))
    assert dict(gen.sampling) == {"temperature": 0.2, "top_k": -1}  # HF top_k 0 = disabled
    with pytest.raises(ConfigError, match="does not exist") as err:
        load_generation_config(tmp_path / "model", str(tmp_path / "missing"))
    assert err.value.flag == "--generation-config"
    write(tmp_path / "bad", {"top_p": 1.5})
    with pytest.raises(ConfigError, match="top_p"):
        load_generation_config(tmp_path / "bad")
    assert load_generation_config(tmp_path / "none") == GenerationDefaults()


def test_with_defaults_is_pure() -> None:
    raw = {"temperature": 1.0}
    defaults = {"temperature": 0.5, "top_p": 0.5}
    assert with_defaults(raw, defaults) == {"temperature": 1.0, "top_p": 0.5}
    assert raw == {"temperature": 1.0}
