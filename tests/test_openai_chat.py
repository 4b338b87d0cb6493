"""OpenAI chat requests (tools, tool calls, tool results, content parts) become the prompt
tokens transformers' ``apply_chat_template`` gives for the same conversation."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.test_chat_template import TOOL_CHAT, TOOL_TEMPLATE, TOOLS
from tpserve.chat_template_files import load_chat_template
from tpserve.demo import demo_target
from tpserve.server.engine_client import BadRequest
from tpserve.server.openai_api import OpenAIFrontend
from tpserve.server.openai_chat import template_inputs
from tpserve.server.openai_protocol import ChatCompletionRequest


class _Tokenizing:
    """The part of EngineClient that chat prompts use."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def openai_form(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as an OpenAI client sends it: arguments as JSON text, content parts."""
    out = copy.deepcopy(chat)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    out[1]["content"] = [{"type": "text", "text": "Wetter "}, {"type": "text", "text": "in Köln?"}]
    out[0]["role"] = "developer"
    return out


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    """The demo tokenizer with a tool-using chat template, as transformers would save it."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((demo_target() / name).read_text())
    (tmp_path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return tmp_path


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_prompt_ids_equal_apply_chat_template(model: Path, tools: Any) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model)
    expected = list(hf.apply_chat_template(TOOL_CHAT, tools=tools, add_generation_prompt=True,
                                           return_dict=True)["input_ids"])
    front = OpenAIFrontend(_Tokenizing(Tokenizer.from_file(str(model / "tokenizer.json"))),
                           load_chat_template(model), "m")  # type: ignore[arg-type]
    body: dict[str, Any] = {"messages": openai_form(TOOL_CHAT)}
    if tools:
        body["tools"] = tools
    assert front.chat_prompt(ChatCompletionRequest.model_validate(body)) == expected


def test_template_inputs_conversions() -> None:
    req = ChatCompletionRequest.model_validate({"messages": openai_form(TOOL_CHAT),
                                                "tools": TOOLS})
    messages, tools = template_inputs(req)
    assert tools == TOOLS
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["content"] == "Wetter in Köln?"
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Köln"}
    assert messages[3] == {"role": "tool", "content": "12°C, Regen", "tool_call_id": "call_1"}
    none = req.model_copy(update={"tool_choice": "none"})
    assert template_inputs(none)[1] is None
    with pytest.raises(BadRequest, match="cannot force a call"):
        template_inputs(req.model_copy(update={"tool_choice": "required"}))
    raw = ChatCompletionRequest.model_validate({"messages": [{
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "not json"}}]}]})
    assert template_inputs(raw)[0][0]["tool_calls"][0]["function"]["arguments"] == "not json"
