"""Chat templates: every place transformers keeps them, rendered exactly as transformers does.

The reference is transformers itself: ``render_jinja_template`` (what ``apply_chat_template``
renders with) on the same template, conversation, tools and special tokens.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tpserve.chat_template import ChatTemplate, ChatTemplateError
from tpserve.chat_template_files import load_chat_template
from tpserve.errors import ConfigError

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)
# Exercises what tool-using templates (Qwen 2.5, Llama 3.1, Hermes) do: tools as JSON, a date
# from strftime_now, assistant tool_calls with object arguments, tool results by call id,
# `is defined` / `is not none` tests, a namespace, loop controls and a generation block.
TOOL_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif -%}
<|system|>{{ ns.system }} Today is {{ strftime_now('%d %B %Y') }}.
{%- if tools is not none %}
Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}
{%- endif %}<|end|>
{% for m in messages %}
  {%- if m['role'] == 'system' %}{% continue %}{% endif -%}
  {%- if m['role'] == 'assistant' and m.tool_calls is defined -%}
<|assistant|>{% if m.content is defined %}{{ m.content }}{% endif %}{% for c in m.tool_calls %}<call id="{{ c.id }}">{{ c.function.name }}({{ c.function.arguments | tojson(sort_keys=True) }})</call>{% endfor %}<|end|>
  {%- elif m['role'] == 'tool' -%}
<|tool|>[{{ m.tool_call_id }}] {{ m.content }}<|end|>
  {%- elif m['role'] == 'assistant' -%}
<|assistant|>{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}
  {%- else -%}
<|{{ m['role'] }}|>{{ m['content'] }}<|end|>
  {%- endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <now> & 'later' in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Wetter in Köln?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12°C, Regen"},
    {"role": "assistant", "content": "12°C und Regen."},
    {"role": "user", "content": "Danke"},
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def hf_render(source: str, messages: list[dict[str, Any]], tools: Any = None,
              add_generation_prompt: bool = True, **tokens: str) -> str:
    """transformers' own rendering (what apply_chat_template(tokenize=False) returns)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    # transformers drops null-valued message keys before rendering (_normalize_chat_messages)
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    rendered, _ = render_jinja_template(conversations=[chat], tools=tools, chat_template=source,
                                        add_generation_prompt=add_generation_prompt, **tokens)
    return rendered[0]


def write_config(directory: Path, **cfg: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    base = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
            "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps({**base, **cfg}))
    return directory


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_tool_template_renders_as_transformers(with_tools: bool,
                                               add_generation_prompt: bool) -> None:
    tools = TOOLS if with_tools else None
    ours = ChatTemplate(TOOL_TEMPLATE, "<s>", "</s>").render(
        TOOL_CHAT, add_generation_prompt=add_generation_prompt, tools=tools)
    assert ours == hf_render(TOOL_TEMPLATE, TOOL_CHAT, tools, add_generation_prompt, **SPECIALS)
    assert datetime.now().strftime("%d %B %Y") in ours
    assert ("Weather <now> & 'later'" in ours) is with_tools  # tojson does not HTML-escape
    assert '<call id="call_1">get_weather({"city": "Köln"})</call>' in ours
    assert "<|tool|>[call_1] 12°C, Regen<|end|>" in ours
    assert ours.endswith("<|assistant|>") is add_generation_prompt


def test_tokenizer_config_template_and_special_tokens(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template=LLAMA3_LIKE, bos_token="<|begin_of_text|>")
    template = load_chat_template(tmp_path)
    text = template.render(MESSAGES)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert text == hf_render(LLAMA3_LIKE, MESSAGES, bos_token="<|begin_of_text|>")
    assert not template.tokenize_with_special_tokens  # the template wrote BOS itself
    assert template.origin == str(tmp_path / "tokenizer_config.json")


def test_every_special_token_is_visible() -> None:
    src = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}"
    template = ChatTemplate(src, "<s>", "</s>", special_tokens={"unk_token": "<unk>",
                                                                 "pad_token": "<pad>"})
    assert template.render(MESSAGES) == "<s>|</s>|<unk>|<pad>"


def test_transformers_order_of_sources(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template="config:{{ messages | length }}")
    assert load_chat_template(tmp_path).render(MESSAGES) == "config:2"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert load_chat_template(tmp_path).render(MESSAGES) == "json"
    (tmp_path / "chat_template.jinja").write_text("jinja:{{ messages[-1].role }}")
    template = load_chat_template(tmp_path)
    assert template.render(MESSAGES) == "jinja:user"
    assert template.origin == str(tmp_path / "chat_template.jinja")


def test_saved_by_transformers_is_found(tmp_path: Path) -> None:
    """What the issue hit: a recent transformers writes chat_template.jinja, not the config."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")),
                                  bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = LLAMA3_LIKE
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert load_chat_template(tmp_path).render(MESSAGES) == tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_named_templates_default_tool_use_and_choice(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template=[
        {"name": "tool_use", "template": "T{{ tools | length }}"},
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "terse", "template": "S"}])
    template = load_chat_template(tmp_path)
    assert template.render(MESSAGES) == "D2"
    assert template.render(MESSAGES, tools=TOOLS) == "T1"  # transformers picks tool_use too
    assert load_chat_template(tmp_path, choice="terse").render(MESSAGES, tools=TOOLS) == "S"
    with pytest.raises(ConfigError, match="it has: default, terse, tool_use") as err:
        load_chat_template(tmp_path, choice="nope")
    assert err.value.flag == "--chat-template"


def test_additional_chat_templates_dir(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("D")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("T")
    assert load_chat_template(tmp_path).render(MESSAGES, tools=TOOLS) == "T"


def test_named_without_default_is_refused(tmp_path: Path) -> None:
    write_config(tmp_path, chat_template=[{"name": "a", "template": "A"}])
    with pytest.raises(ConfigError, match="none called 'default'"):
        load_chat_template(tmp_path)
    assert load_chat_template(tmp_path, choice="a").render(MESSAGES) == "A"


def test_chat_template_flag_file_and_inline(tmp_path: Path) -> None:
    write_config(tmp_path / "model", chat_template="model")
    file = tmp_path / "mine.jinja"
    file.write_text("file:{{ messages[0].content }}")
    assert load_chat_template(tmp_path / "model", choice=str(file)).render(MESSAGES) == \
        "file:Be brief."
    inline = load_chat_template(tmp_path / "model", choice="{{ 'inline' }}")
    assert inline.render(MESSAGES) == "inline"


def test_tokenizer_dir_first(tmp_path: Path) -> None:
    write_config(tmp_path / "tok", chat_template="tok")
    write_config(tmp_path / "model", chat_template="model")
    assert load_chat_template(tmp_path / "tok", tmp_path / "model").render(MESSAGES) == "tok"
    write_config(tmp_path / "bare")
    assert load_chat_template(tmp_path / "bare", tmp_path / "model").render(MESSAGES) == "model"


def test_fallback_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        template = load_chat_template(tmp_path)
    assert "built-in fallback" in caplog.text
    assert template.source is None and template.tokenize_with_special_tokens
    assert template.render(MESSAGES) == "system: Be brief.\nuser:  Hi \nassistant:"


def test_raise_exception_and_broken_templates() -> None:
    src = ("{% if messages[0]['role'] != 'user' %}"
           "{{ raise_exception('first message must be user') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        ChatTemplate(src).render(MESSAGES)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% if %}")
    # a conversation the template cannot handle is the client's problem (HTTP 400), not a 500
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(MESSAGES)


def test_broken_template_file_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ConfigError, match="chat_template.jinja: chat template does not compile"):
        load_chat_template(tmp_path)


def test_sandbox_blocks_python_internals() -> None:
    from jinja2.exceptions import SecurityError

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises((ChatTemplateError, SecurityError)):
        ChatTemplate(evil).render(MESSAGES)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render(MESSAGES)  # immutable
