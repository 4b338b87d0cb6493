"""Overload, body cap, hostile values, client disconnects and schema-driven fuzzing on one
small server.

``--max-running-requests 2 --max-queued-requests 4`` admits 6 sequences at once; the rest
must get 503 + Retry-After, never a 500 or a hang. Every malformed or extreme input gets a
JSON 4xx naming the problem, and the server keeps serving the others.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.server_proc import running_server

FLAGS = ("--device", "cpu", "--dtype", "float32", "--allreduce", "gloo", "--context-length", "256",
         "--kv-cache-gb", "0.05", "--max-running-requests", "2", "--max-queued-requests", "4",
         "--max-request-bytes", "65536", "--max-new-tokens-limit", "64")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_server(2, *FLAGS, cache=tmp_path_factory.mktemp("cache")) as (url, _):
        yield url


def completion(url: str, stream: bool) -> tuple[int, dict | None, httpx.Headers]:
    body = {"model": "tpserve-demo", "prompt": "burst", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200 or not stream:
            r.read()
            return r.status_code, r.json(), r.headers
        text, reason, done = "", None, False
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text, reason = text + choice["text"], choice["finish_reason"] or reason
        return (200 if done else -1), {"choices": [{"text": text, "finish_reason": reason}],
                                       "usage": None}, r.headers


def kv_idle(url: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        idle = info["kv_pages_free"] == info["kv_pages_total"] and info["num_running_reqs"] == 0
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.2)


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def test_burst_gets_only_200_and_503(server: str) -> None:
    rejected_before = metric(server, "tpserve_requests_total", outcome="rejected")
    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(lambda i: completion(server, i % 2 == 0), range(50)))
    codes = [code for code, _, _ in results]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(200) >= 6 and codes.count(503) >= 1, codes
    for code, body, headers in results:
        if code == 503:
            assert headers.get("retry-after") and "capacity" in body["error"]["message"]
        else:
            choice = body["choices"][0]
            assert choice["finish_reason"] == "length"
            if body["usage"]:
                assert body["usage"]["completion_tokens"] == 16
    rejected = metric(server, "tpserve_requests_total", outcome="rejected") - rejected_before
    assert rejected == codes.count(503)
    info = kv_idle(server)
    assert info["kv_pages_free"] == info["kv_pages_total"]
    assert completion(server, False)[0] == 200, "capacity must be released after the burst"


def test_n_beyond_capacity_is_400(server: str) -> None:
    r = httpx.post(server + "/v1/completions", json={"prompt": "a", "n": 8}, timeout=30)
    assert r.status_code == 400 and "at most 6" in r.json()["error"]["message"]


def test_body_over_cap_is_413(server: str) -> None:
    r = httpx.post(server + "/generate", content=b'{"text": "' + b"a" * 100_000 + b'"}',
                   timeout=30)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_disconnect_mid_stream_frees_kv(server: str) -> None:
    cancelled = metric(server, "tpserve_requests_total", outcome="cancelled")
    body = {"model": "tpserve-demo", "prompt": "long " * 20, "max_tokens": 64, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
    info = kv_idle(server)
    assert info["kv_pages_free"] == info["kv_pages_total"]
    assert metric(server, "tpserve_requests_total", outcome="cancelled") == cancelled + 1


def test_openapi_fuzz_no_server_errors(server: str) -> None:
    import schemathesis
    from schemathesis import GenerationMode

    spec = httpx.get(server + "/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/generate",
            "/metrics"} <= set(spec["paths"])
    schema = schemathesis.openapi.from_dict(spec)
    operations = [op.ok() for op in schema.get_all_operations()]
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    for op in operations:
        cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE),
                          op.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=20, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=cases, rng=st.randoms(use_true_random=False))
        def check(case: schemathesis.Case, rng: random.Random) -> None:
            if isinstance(case.body, dict) and rng.random() < 0.5:
                # Schema-valid shapes with extreme leaves, sent as Python's json writes them.
                content = json.dumps(extreme(case.body, rng)).encode()
                response = httpx.request(case.method, server + case.formatted_path,
                                         content=content, timeout=120)
            else:
                response = case.call(base_url=server, timeout=120)
            statuses[response.status_code] += 1
            if response.status_code >= 500 or not _json_error_or_ok(response):
                failures.append(f"{case.method} {case.path} {case.body!r} -> "
                                f"{response.status_code} {response.text[:200]}")

        check()
    assert not failures, "\n".join(failures[:10])
    assert sum(n for code, n in statuses.items() if code < 300) >= len(operations), statuses
    assert httpx.get(server + "/health", timeout=10).status_code == 200
    info = kv_idle(server)
    assert info["kv_pages_free"] == info["kv_pages_total"]


EXTREMES: list[object] = [10**400, -(10**400), 2**63, -(2**63) - 1, 2**64, 1e308, -1e308,
                          5e-324, float("nan"), float("inf"), -float("inf"), 0, -1]


def extreme(value: object, rng: random.Random) -> object:
    """``value`` with some numbers replaced by extremes and some strings by lone surrogates."""
    if isinstance(value, dict):
        return {k: extreme(v, rng) for k, v in value.items()}
    if isinstance(value, list):
        return [extreme(v, rng) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and rng.random() < 0.6:
        return rng.choice(EXTREMES)
    if isinstance(value, str) and rng.random() < 0.2:
        return value + "\ud800"
    return value


def _json_error_or_ok(response: httpx.Response) -> bool:
    """Every error the server gives is the JSON error body (probes and metrics aside)."""
    if response.status_code < 400:
        return True
    try:
        return response.json()["error"]["code"] == response.status_code
    except (ValueError, KeyError, TypeError):
        return False


def nested(depth: int) -> bytes:
    return b'{"text": "a", "sampling_params": {"stop": ' + b"[" * depth + b"]" * depth + b"}}"


HUGE = 10**400
HOSTILE_GENERATE = [
    ("temperature too large for float", {"temperature": HUGE}, "temperature"),
    ("temperature 1e999 (inf)", b'{"temperature": 1e999}', "temperature"),
    ("temperature NaN", b'{"temperature": NaN}', "temperature"),
    ("temperature above the cap", {"temperature": 1e6}, "temperature"),
    ("top_p NaN", b'{"top_p": NaN}', "top_p"),
    ("repetition_penalty inf", b'{"repetition_penalty": Infinity}', "repetition_penalty"),
    ("seed beyond 64 bits", {"seed": 2**64}, "seed"),
    ("n huge", {"n": HUGE}, "'n'"),
    ("max_new_tokens huge", {"max_new_tokens": HUGE}, "max_new_tokens"),
    ("min_new_tokens huge", {"min_new_tokens": HUGE}, "min_new_tokens"),
    ("logprobs huge", {"logprobs": HUGE}, "logprobs"),
    ("65 stop strings", {"stop": [f"s{i}" for i in range(65)]}, "at most 64"),
    ("stop string of 257 chars", {"stop": ["x" * 257]}, "256 characters"),
    ("10k stop strings", {"stop": ["ab"] * 10_000}, "at most 64"),
    ("257 stop token ids", {"stop_token_ids": list(range(257))}, "at most 256"),
    ("stop token id huge", {"stop_token_ids": [HUGE]}, "stop_token_ids"),
]


def _sampling_body(params: object) -> bytes:
    if isinstance(params, bytes):  # NaN and 1e999 as a client's JSON library may write them
        return b'{"text": "a", "sampling_params": {"max_new_tokens": 4, ' + params[1:] + b"}"
    return json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 4, **params}}).encode()


HOSTILE_BODIES = [
    *[(name, _sampling_body(p), needle) for name, p, needle in HOSTILE_GENERATE],
    ("lone surrogate in text", b'{"text": "ab\\ud800"}', "surrogate"),
    ("lone low surrogate in rid", b'{"text": "a", "rid": "\\udc00x"}', "surrogate"),
    ("JSON nested 20k deep", nested(20_000), "arrays and objects"),
    ("JSON nested 2k deep", nested(2_000), "nested"),
    ("more prompts than the server admits", json.dumps({"text": ["a"] * 100}).encode(), "at most 6"),
    ("10k token-id prompts", json.dumps({"input_ids": [[1]] * 10_000}).encode(), "at most 6"),
    ("prompt ids longer than the context", json.dumps({"input_ids": [1] * 5000}).encode(),
     "context length"),
    ("text longer than the context can hold", json.dumps({"text": "a" * 20_000}).encode(),
     "characters"),
    ("repeated rid in a batch", json.dumps({"text": ["a", "b"], "rid": ["r", "r"]}).encode(),
     "repeat"),
]


@pytest.mark.parametrize("name,content,needle", HOSTILE_BODIES, ids=[b[0] for b in HOSTILE_BODIES])
def test_hostile_generate_bodies_get_json_400(server: str, name: str, content: bytes,
                                              needle: str) -> None:
    r = httpx.post(server + "/generate", content=content, timeout=60)
    assert r.status_code == 400, (name, r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert needle.lower() in message.lower() and len(message) < 1200, (name, message[:300])


HOSTILE_OPENAI = [
    ("/v1/completions", {"temperature": HUGE}, "temperature"),
    ("/v1/completions", {"max_tokens": HUGE}, "max_new_tokens"),
    ("/v1/completions", {"n": HUGE}, "n"),
    ("/v1/completions", {"logprobs": HUGE}, "logprobs"),
    ("/v1/completions", {"seed": HUGE}, "seed"),
    ("/v1/completions", {"min_tokens": HUGE}, "min_new_tokens"),
    ("/v1/completions", {"repetition_penalty": 1e300}, "repetition_penalty"),
    ("/v1/completions", {"stop": ["x"] * 65}, "at most 64"),
    ("/v1/completions", {"stop": ["x" * 300]}, "256 characters"),
    ("/v1/completions", {"prompt": ["a"] * 50}, "at most 6"),
    ("/v1/completions", {"prompt": "a" * 20_000}, "characters"),
    ("/v1/chat/completions", {"top_logprobs": HUGE, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": HUGE}, "max_new_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 20_000}]},
     "characters"),
]


@pytest.mark.parametrize("path,fields,needle", HOSTILE_OPENAI,
                         ids=[f"{p}-{next(iter(f))}" for p, f, _ in HOSTILE_OPENAI])
def test_hostile_openai_bodies_get_json_400(server: str, path: str, fields: dict,
                                            needle: str) -> None:
    base = ({"prompt": "a"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "a"}]})
    r = httpx.post(server + path, content=json.dumps({**base, **fields}).encode(), timeout=60)
    assert r.status_code == 400, (path, fields, r.status_code, r.text[:300])
    assert needle.lower() in r.json()["error"]["message"].lower(), r.text[:300]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_lone_surrogate_and_deep_nesting(server: str, path: str) -> None:
    field = b'"prompt"' if path == "/v1/completions" else b'"messages"'
    value = (b'"ab\\udbff"' if path == "/v1/completions"
             else b'[{"role": "user", "content": "\\udbff"}]')
    for content in (b"{" + field + b": " + value + b"}",
                    b'{"prompt": "a", "stop": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"):
        r = httpx.post(server + path, content=content, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text[:300]


def test_top_k_beyond_vocabulary_is_the_whole_vocabulary(server: str) -> None:
    """It used to overflow the sampler's float32 column (an int past float's range) and take
    every rank down, a concurrent request with them."""
    params = {"max_new_tokens": 8, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        normal = pool.submit(completion, server, True)
        huge = [httpx.post(server + "/generate", timeout=120, json={
            "text": "import ", "sampling_params": {**params, "top_k": k}}) for k in (HUGE, 2048)]
        assert normal.result()[0] == 200
    assert [r.status_code for r in huge] == [200, 200], huge[0].text[:300]
    assert huge[0].json()["output_ids"] == huge[1].json()["output_ids"]  # demo vocab: 2048
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_metric_labels_come_from_fixed_sets(server: str) -> None:
    for i, method in enumerate(("PURGE", "PROPFIND", "MKCOL")):  # parsed, but not in our set
        httpx.request(method, server + "/generate", timeout=30)
        httpx.get(server + f"/no-such-path-{i}", timeout=30)
    # A method the HTTP parser does not know is refused before the app sees it.
    assert httpx.request("BREW0", server + "/generate", timeout=30).status_code == 400
    text = httpx.get(server + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = [s.labels for s in families["tpserve_http_responses"].samples]
    assert not any(lb["method"] in ("PURGE", "PROPFIND", "MKCOL", "BREW0")
                   or "no-such" in lb["path"] for lb in labels)
    assert any(lb["method"] == "other" and lb["path"] == "/generate" for lb in labels)
    assert any(lb["method"] == "GET" and lb["path"] == "other" and lb["status"] == "404"
               for lb in labels)
