"""Pydantic models of the SGLang-compatible native API."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # SGLang clients send fields we ignore

    text: str | list[str] | None = Field(None, description="prompt, or a batch of prompts")
    input_ids: list[int] | list[list[int]] | None = Field(None, description="token ids instead of text")
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)


class AbortRequest(BaseModel):
    rid: str


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    code: int = 400


class ErrorResponse(BaseModel):
    error: ErrorBody


class HealthResponse(BaseModel):
    status: str
