"""Chat templates: Jinja rendering as transformers does it, the fallback, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpserve.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]


def test_renders_tokenizer_config_template(tmp_path: Path) -> None:
    cfg = {"chat_template": LLAMA3_LIKE, "bos_token": {"content": "<|begin_of_text|>"},
           "eos_token": "<|eot_id|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    template = load_chat_template(tmp_path)
    text = template.render(MESSAGES)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not template.tokenize_with_special_tokens  # the template wrote BOS itself


def test_named_templates_use_default(tmp_path: Path) -> None:
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "D{{ messages | length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render(MESSAGES) == "D2"


def test_fallback_without_template(tmp_path: Path) -> None:
    template = load_chat_template(tmp_path)
    assert template.source is None and template.tokenize_with_special_tokens
    assert template.render(MESSAGES) == "system: Be brief.\nuser:  Hi \nassistant:"


def test_raise_exception_becomes_client_error() -> None:
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('first message must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        template.render(MESSAGES)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% if %}")
