"""An OpenAI chat request turned into what a Hugging Face chat template reads.

Messages keep OpenAI's shape with three conversions transformers-style templates expect:
``developer`` becomes ``system``; content given as an array of text parts becomes one string;
and a tool call's ``function.arguments``, a JSON string in OpenAI's API, becomes the object it
encodes (templates such as Qwen's and Llama 3.1's ``tojson`` it). ``tools`` pass through as
given, unless ``tool_choice`` is ``"none"``. Tool calls in the model's *output* are read by the
``--tool-call-parser`` (``tool_parsers.py``); without one they come back as assistant text.
"""

from __future__ import annotations

import json
from typing import Any

from tpserve.server.engine_client import BadRequest
from tpserve.server.openai_protocol import ChatCompletionRequest, ChatMessage


def _arguments(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value  # not JSON: the template gets the string the client sent


def _tool_call(call: Any) -> dict[str, Any]:
    data = call.model_dump(exclude_none=True)
    function = data.get("function") or {}
    if "arguments" in function:
        function["arguments"] = _arguments(function["arguments"])
    return data


def template_message(m: ChatMessage) -> dict[str, Any]:
    content: Any = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def offers_tools(req: ChatCompletionRequest) -> bool:
    """The request hands the model tools (the template sees them; a reply may call them)."""
    return bool(req.tools) and req.tool_choice != "none"


def template_inputs(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]],
                                                         list[dict[str, Any]] | None]:
    """(messages, tools) for ``ChatTemplate.render``; BadRequest for what cannot be honoured."""
    if req.tool_choice not in (None, "auto", "none"):
        raise BadRequest("tool_choice 'required' or a named function is not supported: tpserve "
                         "cannot force a call (no constrained decoding); use 'auto' or 'none'")
    tools = [dict(t) for t in req.tools or ()] if offers_tools(req) else None
    return [template_message(m) for m in req.messages], tools
