"""Chat prompts: the model's Jinja chat template, rendered the way ``transformers`` does.

A template is compiled in Jinja's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
``lstrip_blocks`` (templates are untrusted code from a model repo), with transformers'
helpers: ``raise_exception``, ``strftime_now``, a ``tojson`` filter that does not HTML-escape
(``ensure_ascii``, ``indent``, ``separators``, ``sort_keys`` as in ``json.dumps``), and the
``{% generation %}`` block (rendered as its body). A render sees ``messages`` (keys whose
value is null dropped, as transformers does), ``tools`` (a list, or undefined),
``add_generation_prompt`` and every special token of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ...). The rendered prompt is tokenized without adding special
tokens, again as transformers does: a template that wants BOS writes ``{{ bos_token }}``.

Models without a template (the built-in demo model) get a plain, documented fallback:

    system: You are terse.
    user: Hello
    assistant:

one ``role: content`` line per message, then ``assistant:`` to cue the reply; that prompt is
tokenized with the tokenizer's own special tokens. Where templates are found, and in what
order, is ``tpserve.chat_template_files``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK_ORIGIN = "built-in fallback ('role: content' lines)"


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed to render."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ': wrong inside a prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    for serving it is just its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def compile_template(source: str) -> Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:  # compile once at start-up: a broken template fails then, not per request
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: keys with null values dropped."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


@dataclass(frozen=True)
class ChatTemplate:
    source: str | None  # None: the fallback format
    bos_token: str = ""
    eos_token: str = ""
    origin: str = FALLBACK_ORIGIN  # where the template came from, for logs and /get_model_info
    special_tokens: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    tool_source: str | None = None  # a 'tool_use' template, used when a request brings tools
    _compiled: Template | None = field(default=None, init=False, repr=False, compare=False)
    _tool_compiled: Template | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.source is not None:
            object.__setattr__(self, "_compiled", compile_template(self.source))
        if self.tool_source is not None:
            object.__setattr__(self, "_tool_compiled", compile_template(self.tool_source))

    @property
    def tokenize_with_special_tokens(self) -> bool:
        """A real template writes BOS itself (transformers then tokenizes without specials)."""
        return self.source is None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        if self._compiled is None:
            lines = [f"{m['role']}: {m.get('content') or ''}\n" for m in messages]
            return "".join(lines) + ("assistant:" if add_generation_prompt else "")
        template = self._tool_compiled if tools and self._tool_compiled else self._compiled
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                  **self.special_tokens}
        try:  # tools and documents are always defined, None when absent (as transformers)
            return template.render(**tokens, messages=plain_messages(messages), tools=tools,
                                   documents=None, add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
            # e.g. a template adding a string to a message field this conversation lacks
            raise ChatTemplateError(f"chat template cannot render this conversation: "
                                    f"{type(exc).__name__}: {exc}") from exc

