"""The errors a request can end in before or instead of a normal answer, by HTTP status."""

from __future__ import annotations


class BadRequest(ValueError):
    """Client error: becomes HTTP 400 with the message."""


class ModelNotFound(BadRequest):
    """A request named a model this server does not serve: becomes HTTP 404 (as vLLM and
    OpenAI answer), so a client pointed at the wrong server hears so at once."""


class Overloaded(RuntimeError):
    """Too many requests waiting: becomes HTTP 503 with Retry-After."""


class EngineUnavailable(RuntimeError):
    """The engine thread has stopped or is not answering: becomes HTTP 503."""
