"""Prefix caching: a radix tree over full KV pages, owned by rank 0's scheduler.

Each node is one full page of tokens (``page_size`` ids) hanging under the page that precedes
it, so a path from the root spells a token prefix and names the pages holding its KV. A new
request reuses the pages of its longest cached prefix (always leaving at least one token to
compute, which produces its first logits); a finished, aborted or preempted request hands its
full pages to the tree. Pages referenced by running requests are locked; unlocked leaves are
evicted least-recently-used when the allocator runs dry, and ``flush`` drops every unlocked
page. Only page ids live here: every rank keeps its KV where it is, and followers never know
whether a page was reused.

With an EAGLE-3 draft loaded, the draft's KV shares the page table, but a request that ran
while speculation stepped aside never wrote it: each page says whether its draft KV is
complete, a speculative request matches only such pages, and a later copy of a page that has
its draft KV replaces one that lacks it (when no running request holds the old one).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    page: int
    key: tuple[int, ...]
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    refs: int = 0  # running requests whose prefix goes through this page
    last_used: int = 0
    drafted: bool = False  # the draft's KV of this page was written too


@dataclass
class CacheStats:
    queried_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of them, served from cached pages

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = _Node(page=-1, key=(), parent=None)
        self.num_pages = 0  # pages the tree owns (locked or not)
        self.locked_pages = 0  # of them, used by running requests
        self.stats = CacheStats()
        self._clock = itertools.count(1)
        # Eviction candidates, (last_used, tiebreak, node); stale entries (node since used,
        # locked, grown a child or evicted) are skipped when popped, so no step walks the tree.
        self._candidates: list[tuple[int, int, _Node]] = []
        self._tiebreak = itertools.count()

    def _consider(self, node: _Node) -> None:
        if node is not self.root and node.refs == 0 and not node.children:
            heapq.heappush(self._candidates, (node.last_used, next(self._tiebreak), node))

    def _is_candidate(self, used: int, node: _Node) -> bool:
        parent = node.parent
        return (parent is not None and parent.children.get(node.key) is node
                and node.refs == 0 and not node.children and node.last_used == used)

    def _chunks(self, tokens: Sequence[int], pages: int) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i * ps : (i + 1) * ps]) for i in range(pages)]

    def match(self, tokens: Sequence[int], drafted: bool = False) -> list[_Node]:
        """The cached pages of the longest prefix of ``tokens`` that leaves one token over
        (with ``drafted``: only pages whose draft KV was written).

        The returned path is locked until ``release``; its pages are ``[n.page for n in path]``.
        """
        path: list[_Node] = []
        node = self.root
        now = next(self._clock)
        for chunk in self._chunks(tokens, (len(tokens) - 1) // self.page_size):
            child = node.children.get(chunk)
            if child is None or (drafted and not child.drafted):
                break
            self.locked_pages += child.refs == 0
            child.refs += 1
            child.last_used = now
            path.append(child)
            node = child
        return path

    def release(self, path: list[_Node], tokens: Sequence[int], pages: list[int],
                computed: int, drafted: int = 0) -> list[int]:
        """A request is done with its pages: unlock its matched ``path``, give the tree its
        full pages (the first ``computed`` tokens have KV, the first ``drafted`` draft KV
        entries were written), return the pages to free."""
        for node in path:
            node.refs -= 1
            self.locked_pages -= node.refs == 0
            self._consider(node)
        full = min(computed // self.page_size, len(pages))
        node, free = self.root, list(pages[full:])
        now = next(self._clock)
        for i, (chunk, page) in enumerate(zip(self._chunks(tokens, full), pages[:full],
                                              strict=True)):
            with_draft = (i + 1) * self.page_size <= drafted
            child = node.children.get(chunk)
            if child is None:
                child = _Node(page=page, key=chunk, parent=node, drafted=with_draft)
                node.children[chunk] = child
                self.num_pages += 1
            elif child.page == page:
                child.drafted = child.drafted or with_draft
            elif with_draft and not child.drafted and child.refs == 0:
                free.append(child.page)  # this copy also has the draft's KV: keep it instead
                child.page, child.drafted = page, True
            else:
                free.append(page)  # the same tokens were cached meanwhile: keep one copy
            child.last_used = now
            node = child
        self._consider(node)
        return free

    @property
    def evictable_pages(self) -> int:
        return self.num_pages - self.locked_pages

    def evict(self, count: int) -> list[int]:
        """Free up to ``count`` unlocked pages, least recently used leaves first."""
        freed: list[int] = []
        while self._candidates and len(freed) < count:
            used, _, node = heapq.heappop(self._candidates)
            if not self._is_candidate(used, node):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            node.parent = None
            self.num_pages -= 1
            freed.append(node.page)
            self._consider(parent)
        return freed

    def flush(self) -> list[int]:
        """Drop every unlocked page (locked ones belong to running requests)."""
        return self.evict(self.num_pages)
