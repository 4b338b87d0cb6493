"""launch.spec_vs_plain: rounds alternate the servers' order, batch 1 cycles the prompts, and
the totals ratio weighs every round by its time."""

from __future__ import annotations

import pytest

import launch.spec_vs_plain as svp
from tpserve.bench import DEFAULT_PROMPTS, RunResult


def test_rounds_cycle_prompts_and_report_both_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, tuple[str, ...]]] = []
    speed = {"http://plain": 100.0, "http://spec": 150.0}

    def fake_run(url: str, prompts: list[str], tokens: int, temperature: float,
                 client: object, clients: int | None = None) -> RunResult:
        calls.append((url, tuple(prompts)))
        assert clients == 1
        slow = 2.0 if prompts[0] == DEFAULT_PROMPTS[1] and url == "http://spec" else 1.0
        return RunResult(tokens * len(prompts), tokens * len(prompts) * slow / speed[url],
                         10, None)

    monkeypatch.setattr(svp, "run_batch", fake_run)
    report = svp.main(["--plain", "http://plain", "--spec", "http://spec", "--concurrency", "1",
                       "--rounds", "5", "--warmup", "0", "--max-tokens", "8"])
    firsts = [p[0] for url, p in calls if url == "http://plain"]
    assert firsts == list(DEFAULT_PROMPTS[:5])  # each round the next prompt
    assert [url for url, _ in calls[:4]] == ["http://plain", "http://spec"] * 1 + [
        "http://spec", "http://plain"]  # the order flips every round
    row = report["1"]
    assert row["ratio_median"] == pytest.approx(1.5)
    # Totals: spec took twice as long on one prompt of five: 5 / (4 / 1.5 + 2 / 1.5) = 1.25x.
    assert row["ratio_totals"] == pytest.approx(1.25)
    # Per prompt: the slow one stands out (0.75x), the others at 1.5x.
    assert row["by_prompt"] == pytest.approx({"0": 1.5, "1": 0.75, "2": 1.5, "3": 1.5,
                                              "4": 1.5})
    calls.clear()
    svp.main(["--plain", "http://plain", "--spec", "http://spec", "--concurrency", "1",
              "--rounds", "3", "--warmup", "0", "--same-prompts"])
    assert {p for _, p in calls} == {(DEFAULT_PROMPTS[0],)}


def test_a_round_at_higher_concurrency_is_a_closed_loop_of_clients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At concurrency 8 each round is 8 clients sending ``--requests-per-client`` requests
    each (the next prompts in turn); 1 is one burst of 8."""
    calls: list[tuple[int | None, int]] = []

    def fake_run(url: str, prompts: list[str], tokens: int, temperature: float,
                 client: object, clients: int | None = None) -> RunResult:
        calls.append((clients, len(prompts)))
        return RunResult(tokens * len(prompts), 1.0, 10, None)

    monkeypatch.setattr(svp, "run_batch", fake_run)
    svp.main(["--plain", "http://plain", "--spec", "http://spec", "--concurrency", "8",
              "--rounds", "2", "--warmup", "0"])
    assert calls == [(8, 32)] * 4
    calls.clear()
    svp.main(["--plain", "http://plain", "--spec", "http://spec", "--concurrency", "8",
              "--rounds", "2", "--warmup", "0", "--requests-per-client", "1"])
    assert calls == [(8, 8)] * 4


def test_round_prompts_cycle_and_a_lone_client_sends_one() -> None:
    from tpserve.bench import round_prompts

    assert round_prompts(["a", "b", "c"], 2, 4, first=1) == ["b", "c", "a"] * 2 + ["b", "c"]
    assert round_prompts(["a", "b", "c"], 1, 4, first=2) == ["c"]
    assert round_prompts(["a", "b"], 3, 0) == ["a", "b", "a"]
