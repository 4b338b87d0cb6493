"""The OpenAI-compatible API through the official ``openai`` client, plus auth and /metrics.

One 2-rank CPU server with an API key serves the whole module.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.server_proc import running_server
from tpserve.demo import demo_target

KEY = "sk-tpserve-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = ("--device", "cpu", "--dtype", "float32", "--allreduce", "gloo", "--context-length", "256",
         "--kv-cache-gb", "0.05", "--max-running-requests", "8", "--api-key", KEY)
NO_EOS = {"ignore_eos": True}  # the demo model's random weights may emit EOS at any point



def n_tokens(text: str) -> int:
    """Prompt length in tokens of the shipped demo tokenizer (byte-level BPE)."""
    tok = Tokenizer.from_file(str(demo_target() / "tokenizer.json"))
    return len(tok.encode(text, add_special_tokens=False).ids)

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(2, *FLAGS, cache=tmp_path_factory.mktemp("cache")) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "tpserve-demo"


def test_completion_matches_native_generate(client: openai.OpenAI, server: str) -> None:
    r = client.completions.create(model="tpserve-demo", prompt="def fib(n):", max_tokens=8, temperature=0,
                                  extra_body=NO_EOS)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.object == "text_completion"
    assert r.usage.prompt_tokens == n_tokens("def fib(n):") and r.usage.completion_tokens == 8
    native = httpx.post(server + "/generate", headers=AUTH, timeout=120, json={
        "text": "def fib(n):", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True}}).json()
    assert choice.text == native["text"]


def test_completion_stream_matches(client: openai.OpenAI) -> None:
    args = {"model": "tpserve-demo", "prompt": ["for i in", "import"], "max_tokens": 10, "temperature": 0,
            "extra_body": NO_EOS}
    whole = client.completions.create(**args)
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in client.completions.create(**args, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert reasons == ["length", "length"]
    assert usage is not None and usage.completion_tokens == 20 == whole.usage.completion_tokens


def test_n_and_seed(client: openai.OpenAI) -> None:
    args = {"model": "tpserve-demo", "prompt": "abc", "max_tokens": 8, "temperature": 1.0, "seed": 11,
            "n": 2, "extra_body": NO_EOS}
    a = client.completions.create(**args)
    b = client.completions.create(**args)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert a.usage.completion_tokens == 16 and a.usage.prompt_tokens == n_tokens("abc")


def test_chat_stream_and_not(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    args = {"model": "tpserve-demo", "messages": messages, "max_tokens": 12, "temperature": 0,
            "extra_body": NO_EOS}
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.role == "assistant"
    # The documented fallback template of models without one (the demo model).
    assert whole.usage.prompt_tokens == n_tokens("system: be brief\nuser: hi\nassistant:")
    text, roles, reason = "", [], None
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    assert roles == ["assistant"] and reason == "length"
    assert text == whole.choices[0].message.content


def test_stop_sequence(client: openai.OpenAI) -> None:
    args = {"model": "tpserve-demo", "prompt": "hello", "max_tokens": 24, "temperature": 0,
            "extra_body": NO_EOS}
    free = client.completions.create(**args).choices[0].text
    stop = free[4:6]
    if len(free) < 6 or not stop.strip():
        pytest.skip("demo output too short to pick a stop string")
    cut = client.completions.create(**args, stop=[stop]).choices[0]
    assert cut.text == free[: free.index(stop)] and cut.finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tpserve-demo", prompt="xyz", max_tokens=5, temperature=0,
                                  logprobs=3, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) <= 3 and v <= 0 for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    chat = client.chat.completions.create(model="tpserve-demo", messages=[{"role": "user", "content": "q"}],
                                          max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)


def test_bad_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tpserve-demo", prompt="a", temperature=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tpserve-demo", prompt="a " * 300)  # over the context length
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tpserve-demo", messages=[])


def test_unknown_model_is_404_and_unsupported_modes_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' does not exist"):
        client.completions.create(model="gpt-4o", prompt="a", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o",
                                       messages=[{"role": "user", "content": "q"}])
    for kind in ("json_object", "json_schema"):
        with pytest.raises(openai.BadRequestError, match="constrained"):
            client.chat.completions.create(model="tpserve-demo", max_tokens=2,
                                           messages=[{"role": "user", "content": "q"}],
                                           response_format={"type": kind})
    for extra in ({"suffix": "x"}, {"best_of": 3}):
        with pytest.raises(openai.BadRequestError, match="not supported"):
            client.completions.create(model="tpserve-demo", prompt="a", max_tokens=1, **extra)
    text = client.chat.completions.create(model="tpserve-demo", max_tokens=2,
                                          messages=[{"role": "user", "content": "q"}],
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason in ("length", "stop")


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI, server: str) -> None:
    def ids(bias: dict[str, float] | None) -> list[int]:
        params = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True,
                  **({"logit_bias": bias} if bias else {})}
        return httpx.post(server + "/generate", headers=AUTH, timeout=120, json={
            "text": "def fib(n):", "sampling_params": params}).json()["output_ids"]

    free = ids(None)
    assert ids({str(free[0]): -100})[0] != free[0]
    forced = ids({"300": 100})
    assert forced == [300] * 5
    r = client.completions.create(model="tpserve-demo", prompt="def fib(n):", max_tokens=5,
                                  temperature=0, logit_bias={"300": 100}, extra_body=NO_EOS)
    tok = Tokenizer.from_file(str(demo_target() / "tokenizer.json"))
    assert r.choices[0].text == tok.decode(forced)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tpserve-demo", prompt="a", logit_bias={"300": 101})


def test_auth(server: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server + "/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert "API key" in r.json()["error"]["message"]
        assert httpx.post(server + "/generate", headers=headers, json={"text": "a"},
                          timeout=30).status_code == 401
    assert httpx.get(server + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(server + "/get_server_info", headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(server + "/health", timeout=30).status_code == 200
    assert httpx.get(server + "/metrics", timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0).models.list()


def scrape(server: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(server + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_move_by_the_right_amounts(server: str, client: openai.OpenAI) -> None:
    before = scrape(server)
    client.completions.create(model="tpserve-demo", prompt="abcd", max_tokens=6, temperature=0,
                              extra_body=NO_EOS)
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("tpserve_requests_total", outcome="length") == 1
    assert delta("tpserve_prompt_tokens_total") == n_tokens("abcd")
    assert delta("tpserve_generation_tokens_total") == 6
    assert delta("tpserve_time_to_first_token_seconds_count") == 1
    assert delta("tpserve_inter_token_latency_seconds_count") == 5
    assert delta("tpserve_http_responses_total", method="POST", path="/v1/completions",
                 status="200") == 1
    assert delta("tpserve_allreduce_calls_total", backend="gloo") > 0
    assert after[("tpserve_kv_pages_total", frozenset())] > 0
    assert after[("tpserve_kv_pages_used", frozenset())] == 0
    assert after[("tpserve_num_running_requests", frozenset())] == 0


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI, server: str) -> None:
    prompt = "def parse_arguments(argv):\n    parser = argparse.ArgumentParser()\n" * 3
    first = client.completions.create(model="tpserve-demo", prompt=prompt, max_tokens=4,
                                      temperature=0)
    second = client.completions.create(model="tpserve-demo", prompt=prompt, max_tokens=4,
                                       temperature=0)
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens  # whole pages, never the last token
    native = httpx.post(server + "/generate", json={"text": prompt, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0}}, headers=AUTH, timeout=60).json()
    assert native["meta_info"]["cached_tokens"] == cached
