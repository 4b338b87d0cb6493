"""The body's structure is bounded before json.loads: arrays and objects outside strings."""

from __future__ import annotations

import asyncio
import json

import pytest

from tpserve.server.body import MAX_JSON_CONTAINERS, check_containers, load_json
from tpserve.server.client_errors import BadRequest


def check(body: bytes) -> None:
    asyncio.run(check_containers(body))


def test_brackets_inside_strings_do_not_count() -> None:
    code = "x = [[1, {'a': [2]}]] \\\\ \\" + '"' + "[" * 3 + "\n"
    body = json.dumps({"text": code * 20_000, "stop": ["]"]}).encode()
    assert body.count(b"[") > MAX_JSON_CONTAINERS
    check(body)  # a 1.5 MB code prompt: its brackets are text
    assert load_json(body)["text"] == code * 20_000


@pytest.mark.parametrize("body,needle", [
    (json.dumps({"input_ids": [[1]] * (MAX_JSON_CONTAINERS + 1)}).encode(), "arrays and objects"),
    (json.dumps({"text": ["[{"] * 70_000}).encode(), "JSON strings"),
], ids=["containers", "strings full of brackets"])
def test_structure_heavy_bodies_are_refused(body: bytes, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        check(body)


def test_exactly_the_limit_is_parsed() -> None:
    body = json.dumps({"input_ids": [[1]] * (MAX_JSON_CONTAINERS - 2)}).encode()  # + 2 outer
    check(body)
    assert len(load_json(body)["input_ids"]) == MAX_JSON_CONTAINERS - 2
    with pytest.raises(BadRequest):
        check(body.replace(b"[[1]", b"[[1],[1]", 1))


@pytest.mark.parametrize("body,needle", [
    (b'{"text": "\\ud800"}', "surrogate"),
    (b'{"text": "\\udc00\\ud800"}', "surrogate"),
    (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
    (b"[1]", "JSON object"),
    (b"{bad", "malformed"),
])
def test_load_json_refusals(body: bytes, needle: str) -> None:
    with pytest.raises(BadRequest, match=needle):
        load_json(body)


def test_surrogate_pairs_are_text() -> None:
    assert load_json(b'{"text": "\\ud83d\\ude42 \\\\ud800"}')["text"] == "\U0001f642 \\ud800"
