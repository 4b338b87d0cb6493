"""The messages rank 0 sends every other rank, one dataclass per kind, and their byte codec.

A follower learns what to do only from these: it dispatches on the message's type
(``Follower.handle``), so what travels between ranks is defined here and nowhere else. The set
is closed (``StepMessage``); adding a kind means adding it to ``MESSAGE_TYPES`` too.

Messages carry compact integers (tokens, lengths, page tables); each rank expands them into
tensors itself, so a message stays a few hundred bytes whatever the context length.
The codec writes numpy arrays as raw bytes behind a small header (no pickling of classes):
what a rank receives is exactly the fields below, nothing executable.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import Any, Union

import numpy as np


@dataclass(frozen=True)
class DraftFeed:
    """What a plain forward step tells the speculative decoder when a draft is loaded.

    The draft follows only the step's requests in ``rows``: those admitted while speculation
    was on or could pay (``Engine._follow_new``), until let go after a long stretch aside. The
    others cost what they cost on a server without a draft (no auxiliary states, no draft
    work); they never speculate."""

    rows: np.ndarray  # [T] int32: indices (into the step's requests) of the followed ones
    keys: np.ndarray  # [T] int64: the decoder's key of each followed request
    drop: np.ndarray  # [D] int64: keys whose state is forgotten (finished, or let go)
    prev_tokens: np.ndarray  # flat int64: per followed request, tokens pairing with held features
    prev_lens: np.ndarray  # [T] int32: how many of prev_tokens belong to each followed request
    fresh: np.ndarray  # [T] bool: the request's first chunk since admission (no draft state)
    # [T] bool: keep this step's features pending instead of extending the draft now (plain
    # decode steps while speculation steps aside: the next speculative step writes them in one
    # batched draft forward; past ``MAX_DEFERRED`` rows the request is let go, or its rows
    # are written then where following still pays: ``SpecDecoder.draft_feed``)
    defer: np.ndarray | None = None


@dataclass(frozen=True)
class ForwardStep:
    """A target forward over prompt chunks and/or one decode token per request."""

    token_ids: np.ndarray  # [N] int64: each request's q_len tokens, request by request
    q_lens: np.ndarray  # [B] int32: tokens fed this step per request
    cached_lens: np.ndarray  # [B] int32: tokens already in the cache before this step
    page_table: np.ndarray  # [B, P] int32: page ids covering cached + q_len tokens
    logit_rows: np.ndarray  # [K] int64: rows of token_ids whose logits are sampled
    feed: DraftFeed | None = None  # set when a draft model is loaded
    # Every sampled row is a plain greedy pick (``sampler.argmax_pick``, no log-probabilities
    # asked): the ranks exchange their vocab shards' picks, not the logits
    # (``ModelRunner.picks_greedy``).
    greedy: bool = False


@dataclass(frozen=True)
class SpecStep:
    """A speculative step: extend the draft over pending tokens, draft a tree, verify it."""

    token_ids: np.ndarray  # [M] int64: per request, tokens whose draft KV is not yet written
    q_lens: np.ndarray  # [B] int32
    cached_lens: np.ndarray  # [B] int32: sequence length minus the pending tokens
    page_table: np.ndarray  # [B, P] int32
    keys: np.ndarray  # [B] int64
    drop: np.ndarray  # [D] int64
    # Every request's acceptance is the argmax of the raw verify logits (greedy, no
    # penalties, no min_new_tokens still due): a drafting follower may then work out the
    # commit and the next plan itself and draft ahead (``Drafter.run_ahead``).
    greedy: bool = False


@dataclass(frozen=True)
class SpecCommit:
    """The accepted path through each request's verified tree (rank 0 decides)."""

    nodes: np.ndarray  # flat int64: accepted node indices, root first, request by request
    lens: np.ndarray  # [B] int32

    def paths(self) -> list[list[int]]:
        nodes, out, at = self.nodes.tolist(), [], 0
        for n in self.lens.tolist():
            out.append(nodes[at : at + n])
            at += n
        return out

    @staticmethod
    def of(paths: list[list[int]]) -> SpecCommit:
        flat = [n for p in paths for n in p]
        return SpecCommit(np.array(flat, dtype=np.int64),
                          np.array([len(p) for p in paths], dtype=np.int32))


@dataclass(frozen=True)
class SpecSettings:
    enabled: bool
    num_steps: int
    topk: int
    num_draft_tokens: int


@dataclass(frozen=True)
class ConfigChange:
    """A live change every rank applies between the same two steps."""

    allreduce: str | None = None
    speculative: SpecSettings | None = None


@dataclass(frozen=True)
class Shutdown:
    """Leave the follower loop and exit."""


@dataclass(frozen=True)
class Committed:
    """A speculative step's commit riding with the message after it. Rank 0 holds each
    commit back until its next message goes out: the drafting follower reads the commit only
    after drafting ahead, when the next plan is out too, so one message a step (one wait and
    one decode on that rank's critical path) instead of two. A follower applies ``commit``,
    then runs ``then``."""

    commit: SpecCommit
    then: ForwardStep | SpecStep | ConfigChange | Shutdown


@dataclass(frozen=True)
class Guessed:
    """A held commit and the plan after it that are exactly what the drafting follower
    worked out itself from the verify logits (``Drafter.guess``): it takes both from its own
    guess instead of decoding them (~50 us a step on its critical path). Rank 0 sends it only
    where that follower is the only other rank and it checked the plan field by field.
    ``fingerprint``: of the guessed tokens, so a follower whose guess differs (its logits
    would have to) fails loudly instead of running another plan. ``page_table``: the plan's,
    where only it differs from the guess (a request took a new page, one step in ~5 at
    batch 1); the follower checks as for any plan whether its tree still applies."""

    fingerprint: int
    page_table: np.ndarray | None = None


@dataclass(frozen=True)
class AsGuessed:
    """The next plain step is exactly the one every follower worked out from the last one and
    its greedy picks (``engine/plain_guess.py``), field by field: a follower runs its own
    (already prepared) instead of decoding a plan. ``fingerprint``: ``plan_fingerprint`` of
    that step, so a follower whose guess differs fails loudly."""

    fingerprint: int


StepMessage = Union[ForwardStep, SpecStep, SpecCommit, ConfigChange, Shutdown,  # noqa: UP007
                    Committed, Guessed, AsGuessed]
MESSAGE_TYPES: tuple[type, ...] = (ForwardStep, SpecStep, SpecCommit, ConfigChange, Shutdown,
                                   DraftFeed, SpecSettings, Committed, Guessed, AsGuessed)
_TYPE_INDEX = {t: i for i, t in enumerate(MESSAGE_TYPES)}
_DTYPES = ("int64", "int32", "bool", "float32")
# Looked up per field on every step on both sides of the channel: str(dtype), np.prod and
# dataclasses.fields cost 5-9 us a call, most of a 122-byte plan's ~30 us encode and ~50 us
# decode (rank 1 decodes before it can start the step).
_DTYPE_CODE = {np.dtype(name): code for code, name in enumerate(_DTYPES)}
_FIELDS = {t: tuple(f.name for f in dataclasses.fields(t)) for t in MESSAGE_TYPES}


def encode(msg: StepMessage) -> bytes:
    out = bytearray()
    _put(out, msg)
    return bytes(out)


def decode(data: bytes) -> StepMessage:
    value, end = _get(memoryview(data), 0)
    if end != len(data):
        raise ValueError(f"trailing bytes in step message ({len(data) - end})")
    return value


def _put(out: bytearray, value: Any) -> None:
    if value is None:
        out += b"N"
    elif isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        code = _DTYPE_CODE.get(arr.dtype)
        if code is None:
            raise TypeError(f"cannot encode a {arr.dtype} array in a step message")
        out += b"A" + struct.pack("<BB", code, arr.ndim)
        out += struct.pack(f"<{arr.ndim}q", *arr.shape) + arr.tobytes()
    elif isinstance(value, bool):
        out += b"B" + struct.pack("<?", value)
    elif isinstance(value, int):
        out += b"I" + struct.pack("<q", value)
    elif isinstance(value, str):
        raw = value.encode()
        out += b"S" + struct.pack("<I", len(raw)) + raw
    elif type(value) in _TYPE_INDEX:
        out += b"D" + struct.pack("<B", _TYPE_INDEX[type(value)])
        for name in _FIELDS[type(value)]:
            _put(out, getattr(value, name))
    else:
        raise TypeError(f"cannot encode {type(value).__name__} in a step message")


def _get(buf: memoryview, at: int) -> tuple[Any, int]:
    tag, at = bytes(buf[at : at + 1]), at + 1
    if tag == b"N":
        return None, at
    if tag == b"A":
        dtype, ndim = struct.unpack_from("<BB", buf, at)
        shape = struct.unpack_from(f"<{ndim}q", buf, at + 2)
        at += 2 + 8 * ndim
        count = math.prod(shape)
        arr = np.frombuffer(buf, dtype=_DTYPES[dtype], count=count, offset=at).reshape(shape)
        return arr.copy(), at + arr.nbytes
    if tag == b"B":
        return struct.unpack_from("<?", buf, at)[0], at + 1
    if tag == b"I":
        return struct.unpack_from("<q", buf, at)[0], at + 8
    if tag == b"S":
        (n,) = struct.unpack_from("<I", buf, at)
        return bytes(buf[at + 4 : at + 4 + n]).decode(), at + 4 + n
    if tag == b"D":
        cls = MESSAGE_TYPES[buf[at]]
        at += 1
        values = {}
        for name in _FIELDS[cls]:
            values[name], at = _get(buf, at)
        return cls(**values), at
    raise ValueError(f"corrupt step message (tag {tag!r})")
