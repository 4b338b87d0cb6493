"""Prompt text to token ids off the event loop, with the length bounded before any work.

A prompt longer than ``max_chars`` cannot fit the context whatever it says: no token covers
more characters than the longest vocabulary entry, so such a text needs more tokens than the
context holds. It is refused at once, without tokenizing. Shorter texts are tokenized (and
chat templates rendered) on worker threads: ``tokenizers`` releases the GIL while encoding,
so the event loop, ``/health`` included, keeps answering. Long texts get their own worker at
a lower CPU priority, so a client sending large bodies queues behind itself rather than in
front of short prompts, and yields the CPU to the engine's ranks.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tokenizers import Tokenizer

from tpserve.server.client_errors import BadRequest

R = TypeVar("R")
# ~30 ms of tokenizing on the 2-core CI machine (1.9 us per character measured under load).
LONG_TEXT_CHARS = 16384
LONG_TEXT_NICE = 10
# Unicode normalisers can fold a few characters into one (NFC composes a base and its marks).
NORMALIZER_FOLD = 4


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """Most input characters one token can stand for (byte-level vocabularies spell a token
    with one character per byte, which is never fewer than the text characters it covers)."""
    return max((len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True)), default=1)


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LONG_TEXT_NICE)
    except OSError:
        pass  # a platform without per-thread priorities: the queueing still applies


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, context_length: int) -> None:
        self.tokenizer = tokenizer
        fold = NORMALIZER_FOLD if tokenizer.normalizer is not None else 1
        self.max_chars = context_length * longest_token_chars(tokenizer) * fold
        self.context_length = context_length
        self._short = ThreadPoolExecutor(1, thread_name_prefix="tpserve-tokenize")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="tpserve-tokenize-long",
                                        initializer=_lower_priority)

    def check_chars(self, chars: int) -> None:
        if chars > self.max_chars:
            raise BadRequest(f"prompt has {chars} characters: more than the {self.context_length}"
                             f"-token context can hold (at most {self.max_chars} characters)")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_chars(len(text))
        return await self.run(len(text), self._encode, text, add_special_tokens)

    async def run(self, size: int, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` on the worker for work of ``size`` characters."""
        pool = self._long if size > LONG_TEXT_CHARS else self._short
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as exc:  # noqa: BLE001 - a text the tokenizer rejects is a client error
            raise BadRequest(f"cannot tokenize the prompt: {exc}") from None

    def close(self) -> None:
        for pool in (self._short, self._long):
            pool.shutdown(wait=False, cancel_futures=True)
