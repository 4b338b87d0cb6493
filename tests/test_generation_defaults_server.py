"""generation_config.json's sampling defaults reach /generate and both OpenAI routes, and
/get_model_info shows them (demo model, one rank, --generation-config DIR)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_proc import running_server

FLAGS = ("--dtype", "float32", "--context-length", "256", "--kv-cache-gb", "0.05",
         "--max-running-requests", "4", "--skip-server-warmup")
DEFAULTS = {"temperature": 0.0, "max_new_tokens": 5}
PROMPT = "def "


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cache = tmp_path_factory.mktemp("gen")
    (cache / "generation_config.json").write_text(json.dumps({**DEFAULTS, "eos_token_id": 1}))
    with running_server(1, "--generation-config", str(cache), *FLAGS, cache=cache) as (url, _):
        yield url


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_model_info_shows_defaults(server: str) -> None:
    info = httpx.get(server + "/get_model_info", timeout=30).json()
    assert info["sampling_defaults"] == DEFAULTS
    assert info["generation_config"].endswith("generation_config.json")
    assert info["served_model_name"] == "tpserve-demo"


def test_generate_inherits_what_it_leaves_out(server: str) -> None:
    explicit = post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}})
    inherited = post(server, "/generate", {"text": PROMPT,
                                           "sampling_params": {"ignore_eos": True}})
    assert inherited["output_ids"] == explicit["output_ids"]
    assert len(inherited["output_ids"]) == 5
    longer = post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 9, "ignore_eos": True}})
    assert longer["output_ids"][:5] == explicit["output_ids"] and len(longer["output_ids"]) == 9
    sampled = [post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "temperature": 1.5, "seed": s, "ignore_eos": True}})["output_ids"] for s in range(4)]
    assert any(ids != explicit["output_ids"] for ids in sampled)  # the request's value wins


def test_openai_routes_inherit_defaults(server: str) -> None:
    greedy = post(server, "/generate", {"text": PROMPT, "sampling_params": {
        "temperature": 0, "max_new_tokens": 5, "ignore_eos": True}})
    # no temperature and no max_tokens: the model's 0.0 and 5, not OpenAI's 1.0 and 16
    comp = post(server, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True})
    assert comp["choices"][0]["text"] == greedy["text"]
    assert comp["usage"]["completion_tokens"] == 5
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == 5
    again = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "ignore_eos": True})
    assert again["choices"][0]["message"] == chat["choices"][0]["message"]  # greedy
    asked = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                             "ignore_eos": True})
    assert asked["usage"]["completion_tokens"] == 3
