"""Stop-string matching for one request: an Aho-Corasick automaton fed the text as it streams.

Every request with stop strings gets one automaton over all of them, built once. Feeding it a
chunk of new text costs O(chunk length) amortised, whatever the number or length of the stop
strings, so a request with many stop strings cannot slow the engine loop down for everyone
else. The automaton's state also says how much trailing text may still grow into a stop
string: that much is held back from streaming until it is decided.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    start: int  # index in the whole fed text where the matched stop string begins
    stop: str


class _Automaton:
    """Trie of the patterns with failure links; ``out`` is the longest pattern ending at a node."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.patterns = tuple(patterns)
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.out = [-1]  # pattern index of the longest pattern that is a suffix of the node
        for index, pattern in enumerate(self.patterns):
            node = 0
            for ch in pattern:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.out.append(-1)
                node = nxt
            self.out[node] = index
        self.fail = self._failure_links()

    def _failure_links(self) -> list[int]:
        fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in self.goto[node].items():
                queue.append(child)
                back = fail[node]
                while back and ch not in self.goto[back]:
                    back = fail[back]
                target = self.goto[back].get(ch, 0)
                fail[child] = target if target != child else 0
                if self.out[child] < 0:
                    self.out[child] = self.out[fail[child]]  # BFS: the shorter node is final
        return fail

    def step(self, node: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while node and ch not in goto[node]:
            node = fail[node]
        return goto[node].get(ch, 0)


class StopChecker:
    """Finds the request's stop strings in its streamed text, one chunk at a time.

    ``feed`` takes each new chunk in order and returns the match, if the chunk completed one;
    ``held`` is how many trailing characters of the text fed so far are a proper prefix of a
    stop string and must not be streamed yet.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._auto = _Automaton([s for s in stop if s]) if any(stop) else None
        self._node = 0
        self._fed = 0

    @property
    def active(self) -> bool:
        return self._auto is not None

    @property
    def held(self) -> int:
        return self._auto.depth[self._node] if self._auto is not None else 0

    def feed(self, chunk: str) -> StopMatch | None:
        """Advance over ``chunk``; the completed stop string that begins earliest, if any.

        Within one chunk (a token can decode to several characters) every ending position is
        examined, so of two stop strings completed by the same token the one that begins
        first wins, as a search over the whole text would decide.
        """
        auto = self._auto
        if auto is None:
            self._fed += len(chunk)
            return None
        best: StopMatch | None = None
        node = self._node
        for offset, ch in enumerate(chunk):
            node = auto.step(node, ch)
            index = auto.out[node]
            if index >= 0:
                stop = auto.patterns[index]
                start = self._fed + offset + 1 - len(stop)
                if best is None or start < best.start:
                    best = StopMatch(start, stop)
        self._node = node
        self._fed += len(chunk)
        return best

    def check(self, text: str, new_start: int) -> int | None:
        """Stateless: where the earliest stop string overlapping ``text[new_start:]`` begins."""
        if self._auto is None:
            return None
        longest = max(len(p) for p in self._auto.patterns)
        start = max(0, new_start - longest + 1)
        probe = StopChecker(())
        probe._auto, probe._fed = self._auto, start  # the same automaton, a fresh state
        found = probe.feed(text[start:])
        return found.start if found is not None else None

    def safe_prefix_len(self, text: str) -> int:
        """Stateless: length of the prefix of ``text`` no later text can turn into a stop."""
        if self._auto is None:
            return len(text)
        node = 0
        for ch in text[-max(len(p) for p in self._auto.patterns):]:
            node = self._auto.step(node, ch)
        return len(text) - self._auto.depth[node]
