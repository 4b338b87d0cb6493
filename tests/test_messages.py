"""Step messages: every kind survives the byte codec exactly, and bad bytes are refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tpserve.engine.messages import (
    MESSAGE_TYPES,
    AsGuessed,
    Committed,
    ConfigChange,
    DraftFeed,
    ForwardStep,
    Guessed,
    Shutdown,
    SpecCommit,
    SpecSettings,
    SpecStep,
    decode,
    encode,
)


def _forward(feed: bool) -> ForwardStep:
    rng = np.random.default_rng(0)
    draft = DraftFeed(np.array([0, 1], dtype=np.int32),
                      np.array([7, 9], dtype=np.int64), np.array([], dtype=np.int64),
                      np.array([4, 5, 6], dtype=np.int64), np.array([0, 3], dtype=np.int32),
                      np.array([True, False]))
    return ForwardStep(rng.integers(0, 1000, (2, 5)), np.array([5, 1], dtype=np.int32),
                       np.array([0, 17], dtype=np.int32),
                       rng.integers(1, 50, (2, 3)).astype(np.int32),
                       np.array([4, 5], dtype=np.int64), draft if feed else None)


MESSAGES = [
    _forward(False), _forward(True),
    SpecStep(np.zeros((3, 2), dtype=np.int64), np.array([1, 2, 1], dtype=np.int32),
             np.array([10, 11, 12], dtype=np.int32), np.ones((3, 4), dtype=np.int32),
             np.array([1, 2, 3], dtype=np.int64), np.array([99], dtype=np.int64)),
    SpecCommit.of([[0, 2, 3], [0], [0, 1]]),
    ConfigChange(allreduce="shm"), ConfigChange(speculative=SpecSettings(True, 4, 2, 8)),
    ConfigChange(), Shutdown(),
    Committed(SpecCommit.of([[0, 1], [0]]), _forward(True)), Guessed(0xFFFFFFFF),
    Guessed(3, np.array([[4, 5, 0]], dtype=np.int32)), AsGuessed(0xFFFFFFFF),
    dataclasses.replace(_forward(False), greedy=True),
]


def _equal(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())  # type: ignore[union-attr]
    if dataclasses.is_dataclass(a):
        return all(_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_is_exact(msg: object) -> None:
    data = encode(msg)  # type: ignore[arg-type]
    assert isinstance(data, bytes)
    assert _equal(decode(data), msg)


def test_every_kind_is_registered_and_compact() -> None:
    kinds = {type(m) for m in MESSAGES}
    assert kinds | {DraftFeed, SpecSettings} == set(MESSAGE_TYPES)
    # A decode step of 32 requests with 64-page tables stays well under a page of shared memory.
    step = ForwardStep(np.zeros((32, 1), np.int64), np.ones(32, np.int32), np.ones(32, np.int32),
                       np.zeros((32, 64), np.int32), np.arange(32))
    assert len(encode(step)) < 32 * (8 + 4 + 4 + 64 * 4 + 8) + 100
    assert len(encode(Guessed(7))) == 12  # what replaces a whole commit and plan
    assert len(encode(AsGuessed(7))) == 11  # and a whole plain plan


def test_spec_commit_paths_round_trip() -> None:
    paths = [[0, 2, 3], [0], [0, 1]]
    assert SpecCommit.of(paths).paths() == paths


@pytest.mark.parametrize("data", [b"X", b"D\xff", encode(Shutdown()) + b"\0"])
def test_bad_bytes_are_refused(data: bytes) -> None:
    with pytest.raises((ValueError, IndexError)):
        decode(data)


def test_unknown_values_cannot_be_encoded() -> None:
    with pytest.raises(TypeError):
        encode(ConfigChange(allreduce=3.5))  # type: ignore[arg-type]
