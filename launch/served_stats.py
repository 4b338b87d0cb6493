"""Statistics of streamed generations: what a served benchmark reports, as pure functions.

A ``Trace`` is one streamed request as the client saw it: when it was sent and, per
server-sent event, the arrival time and the number of output tokens so far. Everything is
derived from client-side clocks, so HTTP, tokenizer and scheduling costs are included, as a
user would see them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Trace:
    sent: float
    events: tuple[tuple[float, int], ...]  # (arrival time, output tokens so far)
    prompt_tokens: int

    @property
    def ttft(self) -> float:
        return self.events[0][0] - self.sent

    @property
    def tokens(self) -> int:
        return self.events[-1][1] if self.events else 0

    def gaps(self) -> list[tuple[float, float, int]]:
        """(start, end, new tokens) between consecutive events."""
        ev = self.events
        return [(a[0], b[0], b[1] - a[1]) for a, b in zip(ev, ev[1:])]


def median(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated q-th percentile (0..100), numpy's default method."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def decode_rate(trace: Trace) -> float:
    """Tokens/s after the first token: the decode part of one stream."""
    span = trace.events[-1][0] - trace.events[0][0]
    return (trace.tokens - trace.events[0][1]) / span if span > 0 else math.nan


def itl(traces: Sequence[Trace]) -> list[float]:
    """Inter-token latencies: each event gap shared equally by the tokens it delivered."""
    out = []
    for t in traces:
        for start, end, n in t.gaps():
            out += [(end - start) / n] * n if n > 0 else []
    return out


def steady_decode_rate(traces: Sequence[Trace]) -> float:
    """Aggregate tokens/s while every stream is decoding (all have their first token, none done).

    That window is what llama-batched-bench's S_TG times: B sequences decoding together,
    prompts excluded. When the streams never all overlap (admitted in waves), the rate over
    the whole decode span of all streams is returned instead.
    """
    start = max(t.events[0][0] for t in traces)
    end = min(t.events[-1][0] for t in traces)
    if end <= start:
        first = min(t.events[0][0] for t in traces)
        last = max(t.events[-1][0] for t in traces)
        decoded = sum(t.tokens - t.events[0][1] for t in traces)
        return decoded / (last - first) if last > first else math.nan
    tokens = sum(b[1] - a[1] for t in traces for a, b in zip(t.events, t.events[1:])
                 if start < b[0] <= end)
    return tokens / (end - start)


def output_rate(traces: Sequence[Trace]) -> float:
    """All output tokens / wall time from the first request sent to the last token."""
    span = max(t.events[-1][0] for t in traces) - min(t.sent for t in traces)
    return sum(t.tokens for t in traces) / span


def longest_gap(trace: Trace, start: float, end: float) -> float:
    """The longest wait between a stream's tokens that overlaps the interval [start, end]."""
    overlapping = [b - a for a, b, _ in trace.gaps() if b > start and a < end]
    return max(overlapping, default=math.nan)


def paired_ratio(ours: Sequence[float | None], theirs: Sequence[float | None]) -> float:
    """Median over rounds of ours/theirs, rounds where both were measured and positive (a cost
    fitted from noisy rates can come out negative; its ratio means nothing).

    Alternating engines round by round, each round's ratio compares the two under the same
    machine conditions; the median discards the rounds a neighbour disturbed.
    """
    pairs = [a / b for a, b in zip(ours, theirs)
             if a is not None and b is not None and a > 0 and b > 0]
    return median(pairs)
