"""Sampling draws on the logits' device, so each request's generator must live there too
(a CPU generator cannot drive a CUDA draw; issue 19 item 1). Checked on CPU by recording
which device the request factory and the HTTP client ask for."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import tpserve.engine.request as request_module
from tests.harness import byte_tokenizer
from tpserve.engine.sampling_params import SamplingParams
from tpserve.server.engine_client import ClientLimits, EngineClient


def test_new_request_builds_its_generator_on_the_given_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def record(seed: Any, fallback: int, device: Any = "cpu") -> torch.Generator:
        seen.append(device)
        return torch.Generator()

    monkeypatch.setattr(request_module, "make_generator", record)
    request_module.new_request("r", [1, 2], SamplingParams(), byte_tokenizer(), frozenset(), 0,
                               lambda out: None, torch.device("cuda", 3))
    assert seen == [torch.device("cuda", 3)]


def test_the_http_client_creates_requests_on_the_engines_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> None:
        seen.append(args[-1])
        raise RuntimeError("stop here")

    import tpserve.server.engine_client as client_module

    monkeypatch.setattr(client_module, "new_request", record)
    engine = SimpleNamespace(device=torch.device("cuda", 1), submit=lambda cmd: None)
    limits = ClientLimits(vocab_size=300, context_length=64, max_new_tokens_limit=16,
                          max_queued_requests=4, server_seed=0, max_running_requests=4)
    client = EngineClient(engine, byte_tokenizer(), frozenset(), limits, {})  # type: ignore[arg-type]

    async def first() -> None:
        async for _ in client.generate([1, 2], SamplingParams()):
            break

    with pytest.raises(RuntimeError, match="stop here"):
        asyncio.run(first())
    assert seen == [torch.device("cuda", 1)]
