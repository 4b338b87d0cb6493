"""Chat prompts: the model's Jinja chat template, rendered the way ``transformers`` does.

``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates where
``default`` is used) is compiled in a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception`` and a ``tojson`` filter, and rendered with
``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``. Models without a
template (the built-in demo model) get a plain, documented fallback:

    system: You are terse.
    user: Hello
    assistant:

one ``role: content`` line per message, then ``assistant:`` to cue the reply.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed to render."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _token_text(value: Any) -> str:
    """Special tokens are strings or AddedToken dicts ({"content": ...}) in tokenizer_config."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ChatTemplate:
    source: str | None  # None: the fallback format
    bos_token: str = ""
    eos_token: str = ""
    _compiled: Template | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.source is None:
            return
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        try:  # compile once at start-up: a broken template fails then, not per request
            object.__setattr__(self, "_compiled", env.from_string(self.source))
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc

    @property
    def tokenize_with_special_tokens(self) -> bool:
        """A real template writes BOS itself (transformers then tokenizes without specials)."""
        return self.source is None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._compiled is None:
            lines = [f"{m['role']}: {m.get('content') or ''}\n" for m in messages]
            return "".join(lines) + ("assistant:" if add_generation_prompt else "")
        try:
            return self._compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def load_chat_template(*dirs: Path) -> ChatTemplate:
    """The first ``tokenizer_config.json`` found in ``dirs`` decides; else the fallback."""
    for directory in dirs:
        path = directory / "tokenizer_config.json"
        if path.is_file():
            cfg = json.loads(path.read_text())
            return ChatTemplate(_pick(cfg.get("chat_template")), _token_text(cfg.get("bos_token")),
                                _token_text(cfg.get("eos_token")))
    return ChatTemplate(None)


def _pick(template: Any) -> str | None:
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use"...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
