"""Per-request sampling parameters: the SGLang-compatible schema, parsing and validation.

This module owns the `SamplingParams` value object. Field names and defaults follow SGLang's
`sampling_params` so that `/generate` requests written for SGLang work unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

# Upper bounds that are policy, not physics: they keep one request from monopolising the server.
MAX_N = 16
MAX_TOP_LOGPROBS = 20
# Stop strings are matched by one automaton per request (stop_matcher.py), so their number no
# longer costs per token; these caps bound the automaton (at most 16,384 nodes, ~25 ms to
# build in CPython, off the event loop when large) and the size of a request's state.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# OpenAI's range for a logit bias; the entry cap is policy (each costs a scatter per step).
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_LOGIT_BIAS = 1024
# Temperatures below this sample as greedy (vLLM's threshold too): logits / 1e-40 overflows
# float32 to inf, and the softmax of that is NaN, which no sampler can draw from.
GREEDY_TEMPERATURE = 1e-5
# Above ~100 the softmax of any realistic logits is already uniform to float32 precision.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
PENALTY_RANGE = (-2.0, 2.0)
# 64-bit seeds (torch generators take nothing wider), with room for the +i that n > 1 adds
# per choice.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - MAX_N
_REPR_CHARS = 80  # values quoted in error messages are cut to this: bodies can be megabytes


@dataclass(frozen=True)
class SamplingParams:
    """How one request wants its tokens chosen and when generation should stop."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    skip_special_tokens: bool = True
    min_new_tokens: int = 0
    logprobs: int = 0  # number of top logprobs returned per token; 0 = none
    # (token id, bias) added to the logits before sampling (OpenAI's / SGLang's logit_bias),
    # sorted by id: -100 bans a token, +100 all but forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        """True when sampling degenerates to argmax (temperature below ``GREEDY_TEMPERATURE``,
        or top_k 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when any logit penalty or bias is active, so the sampler can skip that work
        (and speculative acceptance knows it cannot read the raw argmax)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )

    @cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (ids int64, biases float32) CPU tensors, built once: the sampler
        adds them every step, and speculative acceptance once per tree node."""
        ids, biases = zip(*self.logit_bias, strict=True) if self.logit_bias else ((), ())
        return (torch.tensor(ids, dtype=torch.long), torch.tensor(biases, dtype=torch.float32))

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: one lookup per generated token."""
        return frozenset(self.stop_token_ids)

    def clamped(self, vocab_size: int) -> SamplingParams:
        """``top_k`` beyond the vocabulary means the whole vocabulary."""
        if self.top_k > vocab_size:
            return dataclasses.replace(self, top_k=vocab_size)
        return self

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Parse a JSON-like mapping, rejecting unknown keys and ill-typed values."""
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key not in known:
                raise ValueError(f"unknown sampling parameter '{key}'")
            kwargs[key] = _coerce(key, value)
        return cls(**kwargs)

    def validate(self, vocab_size: int, max_new_tokens_limit: int) -> None:
        """Raise ValueError naming the first out-of-range parameter."""
        limit = max_new_tokens_limit
        _in_range("max_new_tokens", self.max_new_tokens, 0, limit)
        _in_range("min_new_tokens", self.min_new_tokens, 0, limit)
        _in_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k",
               f"must be -1 (disabled) or >= 1, got {_short(self.top_k)}")
        _in_range("min_p", self.min_p, 0.0, 1.0)
        _check(0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
               f"must be in (0, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            _in_range(name, getattr(self, name), *PENALTY_RANGE)
        _in_range("n", self.n, 1, MAX_N)
        _in_range("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.seed is not None:
            _in_range("seed", self.seed, SEED_MIN, SEED_MAX)
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        _check(longest <= MAX_STOP_STRING_CHARS, "stop",
               f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {longest}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for tok in self.stop_token_ids:
            _check(0 <= tok < vocab_size, "stop_token_ids",
                   f"token id {_short(tok)} is outside the vocabulary [0, {vocab_size})")
        for tok, bias in self.logit_bias:
            _check(0 <= tok < vocab_size, "logit_bias",
                   f"token id {_short(tok)} is outside the vocabulary [0, {vocab_size})")
            _in_range("logit_bias", bias, *LOGIT_BIAS_RANGE)


def _in_range(name: str, value: float, lo: float, hi: float) -> None:
    # NaN fails both comparisons, so it is refused with the same message.
    _check(lo <= value <= hi, name, f"must be in [{lo}, {hi}], got {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _REPR_CHARS else f"{text[:_REPR_CHARS]}... ({len(text)} chars)"


def _check(ok: bool, name: str, detail: str) -> None:
    if not ok:
        raise ValueError(f"invalid sampling parameter '{name}': {detail}")


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `"top_k": true` is a client bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _type_error(key: str, expected: str, value: Any) -> ValueError:
    return ValueError(
        f"sampling parameter '{key}' must be {expected}, got {type(value).__name__} {_short(value)}"
    )


_INT_FIELDS = frozenset({"max_new_tokens", "top_k", "n", "min_new_tokens", "logprobs"})
_FLOAT_FIELDS = frozenset(
    {
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    }
)
_BOOL_FIELDS = frozenset({"ignore_eos", "skip_special_tokens"})


def _coerce(key: str, value: Any) -> Any:
    """Convert one JSON value to the field's Python type, or raise a message naming the key."""
    if key in _INT_FIELDS:
        if not _is_int(value):
            raise _type_error(key, "an integer", value)
        return value
    if key in _FLOAT_FIELDS:
        return _finite_number(key, value)
    if key in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise _type_error(key, "a boolean", value)
        return value
    if key == "seed":
        if value is not None and not _is_int(value):
            raise _type_error(key, "an integer or null", value)
        return value
    if key == "stop":
        return _coerce_stop(value)
    if key == "stop_token_ids":
        return _coerce_stop_token_ids(value)
    if key == "logit_bias":
        return _coerce_logit_bias(value)
    raise AssertionError(f"field '{key}' has no coercion rule")  # new field added without a rule


def _coerce_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise _type_error("stop", "a string or a list of strings", value)
    if len(value) > MAX_STOP_STRINGS:  # before looking at the items: the list may be huge
        raise ValueError(f"invalid sampling parameter 'stop': at most {MAX_STOP_STRINGS} stop "
                         f"strings, got {len(value)}")
    if not all(isinstance(s, str) for s in value):
        raise _type_error("stop", "a string or a list of strings", value)
    if any(s == "" for s in value):
        raise ValueError("sampling parameter 'stop' must not contain empty strings")
    return tuple(value)


def _coerce_stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise _type_error("stop_token_ids", "a list of integers", value)
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"invalid sampling parameter 'stop_token_ids': at most "
                         f"{MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    if not all(_is_int(t) for t in value):
        raise _type_error("stop_token_ids", "a list of integers", value)
    return tuple(value)


def _coerce_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (a JSON object's keys are strings) to bias, as sorted pairs."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise _type_error("logit_bias", "an object mapping token ids to numbers", value)
    if len(value) > MAX_LOGIT_BIAS:  # before looking at the entries: the map may be huge
        raise ValueError(f"invalid sampling parameter 'logit_bias': at most {MAX_LOGIT_BIAS} "
                         f"entries, got {len(value)}")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        if _is_int(key):
            tok = key
        elif isinstance(key, str) and key.isascii() and key.lstrip("-").isdigit():
            tok = int(key)
        else:
            raise _type_error("logit_bias", "keyed by token ids", key)
        if tok in pairs:
            raise ValueError(f"invalid sampling parameter 'logit_bias': token id {tok} appears "
                             "twice")
        pairs[tok] = _finite_number("logit_bias", bias)
    return tuple(sorted(pairs.items()))


def _finite_number(key: str, value: Any) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise _type_error(key, "a number", value)
    try:
        number = float(value)  # a JSON integer may have 400 digits: float() overflows
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"invalid sampling parameter '{key}': must be a finite number, "
                         f"got {_short(value)}")
    return number
