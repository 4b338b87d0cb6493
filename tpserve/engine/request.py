"""A request's state inside the engine, and the output events it emits to the server."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer

from tpserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from tpserve.engine.sampler import make_generator
from tpserve.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """One event for the server: new text/tokens, and the final state when finished."""

    rid: str
    text: str  # all output text so far (stop strings excluded)
    new_text: str
    output_ids: list[int]
    new_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    meta: dict[str, Any]
    logprobs: list[tuple[int, float, list[tuple[int, float]] | None]] = field(default_factory=list)


# eq=False: a request is itself, not its field values. The scheduler's ``in`` / ``remove``
# on its lists compared whole field tuples against every other running request (~52 dataclass
# __eq__ calls a step at 8 clients, each building two tuples of every field).
@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    stop: StopChecker
    emit: Callable[[RequestOutput], None]
    eos_ids: frozenset[int] = frozenset()
    # False (a collected, not streamed, request): only the first token's event and the final
    # one are emitted. Each event wakes the HTTP thread, which then competes with the ranks
    # for the GIL and the cores: on the 2-core dev VM, per-token events cost a TP=2 batch-1
    # non-streamed request 7-9% of its tok/s (SGLang also sends non-streamed requests once).
    stream: bool = True
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the cache
    prefix_path: list[Any] = field(default_factory=list)  # locked prefix-cache nodes
    cached_prefix: int = 0  # tokens reused from the prefix cache at the last admission
    text: str = ""
    streamed_text: int = 0
    streamed_ids: int = 0
    finish_reason: dict[str, Any] | None = None
    final_sent: bool = False  # the finished event went out: no later event for this request
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]] | None]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens whose KV still has to be computed (1 for a request in decode)."""
        return self.seq_len - self.num_cached

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole sequence: a
        decode step asks for one token, and this runs for every request on every step."""
        n = len(self.prompt_ids)
        head = self.prompt_ids[start:min(end, n)]
        return head + self.output_ids[max(start - n, 0):max(end - n, 0)] if end > n else head

    def meta(self) -> dict[str, Any]:
        now = time.perf_counter()
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason,
            "e2e_latency": now - self.arrival,
        }
        if self.first_token_at is not None:
            meta["ttft"] = self.first_token_at - self.arrival
        meta.update(self.stats)
        return meta


def new_request(rid: str, prompt: list[int], params: SamplingParams, tokenizer: Tokenizer,
                eos_ids: frozenset[int], fallback_seed: int,
                emit: Callable[[RequestOutput], None],
                device: torch.device | str = "cpu", stream: bool = True) -> Request:
    """A request with its own RNG (``params.seed``, else ``fallback_seed``), detokenizer and stops.

    The generator lives on ``device``, the engine's: sampling draws on the logits' device, and
    a CPU generator cannot drive a CUDA draw.
    """
    return Request(
        rid=rid, prompt_ids=list(prompt), params=params,
        generator=make_generator(params.seed, fallback_seed, device),
        detok=IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt),
        stop=StopChecker(params.stop), eos_ids=eos_ids, emit=emit, stream=stream)
