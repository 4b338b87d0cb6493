"""Pydantic models of the OpenAI-compatible API (the subset tpserve implements).

Requests ignore unknown fields (OpenAI clients and SDK wrappers send extras); constraints
here are the static ones, and limits that depend on the server (context length,
``--max-new-tokens-limit``) are checked per request and answered with 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Stop = str | list[str] | None


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="the served model's id (/v1/models); another "
                                                "gets 404")
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16, description="choices per prompt")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = Field(None, description="up to 64 strings of up to 256 characters that end "
                                         "generation (not returned)")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 17,
                             description="same seed + prompt = same output")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id -> bias in [-100, 100] added to its logit")
    response_format: dict[str, Any] | None = Field(
        None, description="only {\"type\": \"text\"}: JSON modes need constrained decoding, "
                          "which tpserve does not do (refused, not ignored)")
    # tpserve extensions (SGLang/vLLM names), e.g. via the openai client's extra_body
    top_k: int | None = Field(None, ge=-1, description="-1 disables")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, texts, token ids, or lists of token ids")
    max_tokens: int | None = Field(16, ge=0, description="default 16")
    logprobs: int | None = Field(None, ge=0, le=20, description="top logprobs per token")
    echo: bool = Field(False, description="not supported: must be false")
    suffix: str | None = Field(None, description="not supported: must be empty")
    best_of: int | None = Field(None, ge=1, description="not supported beyond n")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = Field("{}", description="JSON text, as OpenAI sends it")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="assistant: calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this result answers")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=0, description="default: up to the context length")
    max_completion_tokens: int | None = Field(None, ge=0, description="alias of max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(
        None, description="passed to the chat template; calls in the reply are parsed with "
                          "--tool-call-parser (else they stay text)")
    tool_choice: str | dict[str, Any] | None = Field(None, description="auto | none")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop | length | abort")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop | length | abort")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tpserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
