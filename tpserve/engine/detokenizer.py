"""Streaming text output: incremental detokenization.

This module owns turning a growing list of token ids into text chunks that are safe to stream:
never half a UTF-8 character. Stop strings are matched in ``stop_matcher``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from tpserve.engine.stop_matcher import StopChecker

__all__ = ["IncrementalDetokenizer", "StopChecker"]  # StopChecker: re-exported for request.py

# Prompt tokens decoded as context before the first output token. Tokenizers such as
# SentencePiece render a token differently at the start of a sequence (leading space dropped),
# so the first output token must be decoded after a few real predecessors.
CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, so a run this long that still decodes to a trailing
# U+FFFD is invalid output, not an incomplete character; emit it rather than buffer forever.
MAX_HELD_TOKENS = 16
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decode output tokens as they arrive, O(window) work per call.

    Keeps two offsets into the token list: text for tokens before `_read_offset` has been
    emitted, and `_prefix_offset` marks the start of the context window decoded alongside the
    new tokens, so each step decodes only the last emitted chunk plus the pending tokens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = [int(t) for t in prompt_ids[-CONTEXT_TOKENS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens and return the text they completed (possibly empty)."""
        self._ids.extend(new_ids)
        return self._advance(force=False)

    def finish(self) -> str:
        """Flush held-back text at end of generation, even if it ends in U+FFFD."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        # Held back while the pending tokens end mid-character. Byte-level BPE decodes a split
        # character to a trailing U+FFFD; byte-fallback (``<0xE6>`` tokens) turns the *whole*
        # run of byte tokens into U+FFFDs while it is invalid UTF-8, rewriting text already
        # emitted, so the window must also still start with what was emitted.
        consistent = full_text.startswith(prefix_text)
        settled = consistent and not full_text.endswith(_REPLACEMENT)
        if not settled and not force and pending < MAX_HELD_TOKENS:
            return ""
        # Forced (finish, or a run too long to be one character): what the window still says,
        # else the pending tokens decoded alone.
        chunk = (full_text[len(prefix_text) :] if consistent
                 else self._decode(self._ids[self._read_offset :]))
        if not chunk:
            return ""  # nothing visible yet (e.g. a skipped special token)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += chunk
        return chunk
