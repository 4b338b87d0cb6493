"""The per-request stop-string automaton against a brute-force search over the whole text."""

from __future__ import annotations

import random

import pytest

from tpserve.engine.stop_matcher import StopChecker


def earliest(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The reference: the stop string that begins first in ``text`` (list order breaks ties)."""
    hits = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
    if not hits:
        return None
    start, i = min(hits)
    return start, stops[i]


def held(text: str, stops: list[str]) -> int:
    """Longest suffix of ``text`` that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@pytest.mark.parametrize("alphabet", ["ab", "abc", "aé日🙂"])
def test_streamed_matches_equal_a_whole_text_search(alphabet: str) -> None:
    rng = random.Random(len(alphabet))
    for _ in range(1500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        checker, fed, found = StopChecker(stops), "", None
        while len(fed) < len(text) and found is None:
            chunk = text[len(fed):len(fed) + rng.randint(1, 3)]  # a token is 1-3 characters
            found, fed = checker.feed(chunk), fed + chunk
            if found is None:
                assert earliest(fed, stops) is None, (stops, fed)
                assert checker.held == held(fed, stops), (stops, fed)
        if found is not None:
            start, _ = earliest(fed, stops)  # the first chunk that completes any stop
            assert found.start == start and fed.startswith(found.stop, start), (stops, fed)
        else:
            assert earliest(text, stops) is None


def test_earliest_start_wins_within_one_chunk() -> None:
    checker = StopChecker(["bc", "abcd"])
    found = checker.feed("xabcd")  # both complete inside the chunk; 'abcd' begins first
    assert found is not None and (found.start, found.stop) == (1, "abcd")


def test_match_across_chunks_reports_the_whole_text_index() -> None:
    checker = StopChecker(["</end>"])
    assert checker.feed("hello </") is None and checker.held == 2
    assert checker.feed("en") is None and checker.held == 4
    found = checker.feed("d> tail")
    assert found is not None and (found.start, found.stop) == (6, "</end>")


def test_no_stops_hold_nothing() -> None:
    checker = StopChecker([])
    assert not checker.active and checker.feed("anything") is None and checker.held == 0


def test_largest_allowed_automaton() -> None:
    """64 stop strings of 256 characters (the request limits): built and matched exactly."""
    rng = random.Random(0)
    stops = ["".join(rng.choice("abcdefgh") for _ in range(256)) for _ in range(64)]
    checker = StopChecker(stops)
    text = "".join(rng.choice("abcdefgh") for _ in range(3000)) + stops[41]
    found = None
    for i in range(0, len(text), 3):
        found = found or checker.feed(text[i:i + 3])
    assert found is not None and found.stop == stops[41]
    assert found.start == earliest(text, stops)[0]
