"""Predict tok/s of speculative settings from measured phase times and accept rates.

Per decode step at a fixed concurrency C:

    step_ms(k, N) = draft_ms_per_depth * k  +  verify_ms(N)  +  overhead_ms
    tokens(k)     = C * (1 + sum_{i=1..k} P(accepted >= i))
    tok/s         = 1000 * tokens(k) / step_ms(k, N)

``verify_ms(N)`` is a straight line through the measured target forwards (N = 1 is plain
decode, N = num_draft_tokens for verify). ``P(accepted >= i)`` comes from the server's
per-position accept rates; depths beyond the deepest measured one continue the last measured
conditional rate geometrically (a draft only gets worse further from the verified prefix).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    backend: str
    concurrency: int
    num_steps: int  # 0 = speculation off
    num_draft_tokens: int  # 1 = speculation off
    tok_s: float
    forward_ms: float  # target forward per step (decode or verify)
    draft_ms: float  # draft phase per step
    overhead_ms: float  # everything else per step
    position_rates: tuple[float, ...] = ()  # P(accepted >= i), i = 1..num_steps


@dataclass(frozen=True)
class CostModel:
    draft_ms_per_depth: float
    verify_intercept_ms: float
    verify_ms_per_node: float
    overhead_ms: float
    spec_overhead_ms: float
    conditional_rates: tuple[float, ...]

    def accept_length(self, steps: int) -> float:
        total, reach = 1.0, 1.0
        for depth in range(steps):
            rate = self.conditional_rates[min(depth, len(self.conditional_rates) - 1)] \
                if self.conditional_rates else 0.0
            reach *= rate
            total += reach
        return total

    def step_ms(self, steps: int, nodes: int) -> float:
        verify = self.verify_intercept_ms + self.verify_ms_per_node * nodes
        if steps == 0:
            return verify + self.overhead_ms
        return self.draft_ms_per_depth * steps + verify + self.spec_overhead_ms

    def tok_s(self, steps: int, nodes: int, concurrency: int) -> float:
        tokens = concurrency * (self.accept_length(steps) if steps else 1.0)
        return 1e3 * tokens / self.step_ms(steps, nodes)


def conditional(rates: tuple[float, ...]) -> tuple[float, ...]:
    """P(>= i) -> P(>= i | >= i-1)."""
    out, prev = [], 1.0
    for r in rates:
        out.append(r / prev if prev > 0 else 0.0)
        prev = r
    return tuple(out)


def fit(runs: list[Measurement]) -> CostModel:
    """Fit one backend x concurrency group (needs the no-speculation run and >= 1 spec run)."""
    base = [m for m in runs if m.num_steps == 0]
    spec = [m for m in runs if m.num_steps > 0]
    points = [(m.num_draft_tokens, m.forward_ms) for m in runs]
    slope, intercept = fit_line(points)
    deepest = max(spec, key=lambda m: m.num_steps, default=None)
    return CostModel(
        draft_ms_per_depth=mean([m.draft_ms / m.num_steps for m in spec]),
        verify_intercept_ms=intercept, verify_ms_per_node=slope,
        overhead_ms=mean([m.overhead_ms for m in base]) if base else 0.0,
        spec_overhead_ms=mean([m.overhead_ms for m in spec]),
        conditional_rates=conditional(deepest.position_rates) if deepest else (),
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope and intercept; a single x gives slope 0 through the mean."""
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    mx, my = mean(xs), mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in points) / var
    return slope, my - slope * mx
