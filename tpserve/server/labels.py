"""Client request ids are labels; engine request ids are ours.

A client's ``rid`` (or the id we generate when it sends none) names every engine request of
one HTTP request while it is in flight; a second HTTP request carrying a label that is still
in flight is refused (409), so a label always names one client's work. The engine only ever
sees fresh random ids, so no client can collide with, or abort, another's engine request
by guessing or reusing its label after it finished.
"""

from __future__ import annotations

import uuid

MAX_LABEL_CHARS = 256


class LabelInUse(RuntimeError):
    """Becomes HTTP 409."""


class LabelRegistry:
    """label -> engine request ids; touched only from the event loop."""

    def __init__(self) -> None:
        self._live: dict[str, set[str]] = {}

    def claim(self, labels: list[str]) -> None:
        """Reserve every label of one HTTP request, or none (LabelInUse names the first)."""
        taken = next((label for label in labels if label in self._live), None)
        if taken is not None:
            raise LabelInUse(f"a request with rid {taken[:MAX_LABEL_CHARS]!r} is already in "
                             "flight; rids must be unique among running requests")
        for label in labels:
            self._live[label] = set()

    def release(self, labels: list[str]) -> None:
        for label in labels:
            self._live.pop(label, None)

    def attach(self, label: str) -> str:
        """A fresh engine id for one sequence carrying ``label``."""
        rid = uuid.uuid4().hex
        live = self._live.get(label)  # an unclaimed label (internal requests) is not tracked
        if live is not None:
            live.add(rid)
        return rid

    def detach(self, label: str, rid: str) -> None:
        live = self._live.get(label)
        if live is not None:
            live.discard(rid)

    def engine_ids(self, label: str) -> list[str]:
        return sorted(self._live.get(label, ()))

    def __contains__(self, label: str) -> bool:
        return label in self._live


def new_label() -> str:
    return uuid.uuid4().hex
