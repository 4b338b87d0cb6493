"""Finding a model's chat template in every place transformers keeps one, in its order.

In the tokenizer directory (``--tokenizer``, else the model directory):

1. ``chat_template.jinja`` (what transformers >= 4.47 saves) as the default template, plus
   ``additional_chat_templates/NAME.jinja`` as named ones;
2. else ``chat_template.json`` (``{"chat_template": ...}``, the processors' legacy file);
3. else ``tokenizer_config.json``'s ``chat_template``: a string, or a list of
   ``{"name": ..., "template": ...}`` whose ``default`` is used.

A named ``tool_use`` template is used for requests that bring ``tools`` (transformers picks
it the same way). ``--chat-template`` overrides all of them: a file (its text is the
template), the name of one of the model's named templates, or an inline Jinja string.
Special tokens (``bos_token``, ``eos_token``, ...) come from ``tokenizer_config.json``, then
``special_tokens_map.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import MappingProxyType
from typing import Any

from tpserve.chat_template import ChatTemplate, ChatTemplateError
from tpserve.errors import ConfigError

log = logging.getLogger(__name__)

FLAG = "--chat-template"
JINJA_FILE = "chat_template.jinja"
JSON_FILE = "chat_template.json"
NAMED_DIR = "additional_chat_templates"
CONFIG_FILE = "tokenizer_config.json"

Named = dict[str, tuple[str, str]]  # template name -> (source, where it came from)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", flag=FLAG) from None
    return value if isinstance(value, dict) else {}


def _from_value(value: Any, where: str) -> Named:
    """A ``chat_template`` value: a string, a list of {name, template}, or a name -> text dict."""
    if isinstance(value, str) and value:
        return {"default": (value, where)}
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        return {str(k): (v, f"{where} [{k}]") for k, v in value.items() if isinstance(v, str)}
    return {}


def find_templates(directory: Path) -> Named:
    """Every template of ``directory``, from the first source in transformers' order."""
    found: Named = {}
    if (directory / JINJA_FILE).is_file():
        found["default"] = ((directory / JINJA_FILE).read_text(encoding="utf-8"),
                            str(directory / JINJA_FILE))
    if (directory / NAMED_DIR).is_dir():
        for path in sorted((directory / NAMED_DIR).glob("*.jinja")):
            found[path.stem] = (path.read_text(encoding="utf-8"), str(path))
    if found:
        return found
    if (directory / JSON_FILE).is_file():
        found = _from_value(_json(directory / JSON_FILE).get("chat_template"),
                            str(directory / JSON_FILE))
        if found:
            return found
    if (directory / CONFIG_FILE).is_file():
        return _from_value(_json(directory / CONFIG_FILE).get("chat_template"),
                           str(directory / CONFIG_FILE))
    return {}


def _token_text(value: Any) -> str | None:
    """Special tokens are strings or AddedToken dicts ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(directory: Path) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for name in ("special_tokens_map.json", CONFIG_FILE):  # later files win
        path = directory / name
        if path.is_file():
            for key, value in _json(path).items():
                text = _token_text(value)
                if key.endswith("_token") and text is not None:
                    tokens[key] = text
    return tokens


def _chosen(choice: str, named: Named) -> tuple[str, str]:
    path = Path(choice).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            picked = _from_value(_json(path).get("chat_template"), str(path))
            if "default" not in picked:
                raise ConfigError(f"{path} has no default chat_template", flag=FLAG)
            return picked["default"]
        return text, str(path)
    if choice in named:
        return named[choice]
    if "{{" in choice or "{%" in choice:
        return choice, f"{FLAG} (inline)"
    names = ", ".join(sorted(named)) or "none"
    raise ConfigError(f"{FLAG} '{choice}' is neither a file nor one of the model's named "
                      f"templates (it has: {names})", flag=FLAG)


def load_chat_template(*dirs: Path, choice: str | None = None,
                       announce: bool = True) -> ChatTemplate:
    """The template for ``dirs`` (tokenizer dir first): the first directory holding one decides.

    ``announce`` logs which template is used (a warning for the fallback)."""
    named: Named = {}
    for directory in dirs:
        named = find_templates(Path(directory))
        if named:
            break
    tokens = next((special_tokens(Path(d)) for d in dirs if (Path(d) / CONFIG_FILE).is_file()
                   or (Path(d) / "special_tokens_map.json").is_file()), {})
    tool = None
    if choice:
        source, origin = _chosen(choice, named)
    elif "default" in named:
        source, origin = named["default"]
        tool = named.get("tool_use", (None, ""))[0]
    elif named:
        raise ConfigError(f"the model has named chat templates ({', '.join(sorted(named))}) "
                          f"but none called 'default'; pick one with {FLAG} NAME", flag=FLAG)
    else:
        if announce:
                log.warning("no chat template in %s: chat prompts use the built-in fallback; "
                        "give the model's template with %s FILE",
                        ", ".join(str(d) for d in dirs), FLAG)
        return ChatTemplate(None, tokens.get("bos_token", ""), tokens.get("eos_token", ""),
                            special_tokens=MappingProxyType(tokens))
    try:
        template = ChatTemplate(source, tokens.get("bos_token", ""), tokens.get("eos_token", ""),
                                origin, MappingProxyType(tokens), tool)
    except ChatTemplateError as exc:
        raise ConfigError(f"{origin}: {exc}", flag=FLAG) from None
    if announce:
        log.info("chat template: %s%s", origin, " (+ tool_use with tools)" if tool else "")
    return template
