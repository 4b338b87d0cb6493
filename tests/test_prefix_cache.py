"""Prefix caching: the radix tree's bookkeeping, and outputs unchanged by cache hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.harness import build_engine, make_request, run_all
from tpserve.engine.prefix_cache import PrefixCache
from tpserve.engine.sampling_params import SamplingParams

PS = 4


def test_match_leaves_one_token_and_release_hands_pages_over() -> None:
    cache = PrefixCache(PS)
    tokens = list(range(10, 22))  # 12 tokens = 3 full pages
    assert cache.match(tokens) == []
    free = cache.release([], tokens, [7, 8, 9], computed=12)
    assert free == [] and cache.num_pages == 3
    # The same 12 tokens again: only 2 pages match (the last token must be computed).
    path = cache.match(tokens)
    assert [n.page for n in path] == [7, 8]
    longer = cache.match(tokens + [99])
    assert [n.page for n in longer] == [7, 8, 9]
    # A diverging prompt shares the first page only.
    assert [n.page for n in cache.match(tokens[:4] + [0] * 8)] == [7]


def test_partial_and_duplicate_pages_are_freed() -> None:
    cache = PrefixCache(PS)
    tokens = list(range(10))
    assert cache.release([], tokens, [1, 2, 3], computed=10) == [3]  # page 3 is partial
    # Another request computed the same first page into page 5: one copy is kept.
    assert cache.release([], tokens[:8], [5, 6], computed=8) == [5, 6]


def test_speculative_requests_match_only_pages_with_draft_kv() -> None:
    """A request the draft did not follow leaves pages without draft KV: a speculative
    request must not reuse them (its draft would attend to stale entries), and a later copy
    that has them replaces them once nobody holds the old one."""
    cache = PrefixCache(PS)
    tokens = list(range(10, 23))  # 13 tokens: 3 full pages, one token over
    cache.release([], tokens, [1, 2, 3], computed=12, drafted=0)
    plain = cache.match(tokens, drafted=False)
    assert [n.page for n in plain] == [1, 2, 3]
    cache.release(plain, tokens, [1, 2, 3], computed=12)
    assert cache.match(tokens, drafted=True) == []
    # Draft KV written for 9 entries: pages covering entries [0, 8) are complete, not the 3rd.
    assert cache.release([], tokens, [4, 5, 6], computed=12, drafted=9) == [1, 2, 6]
    path = cache.match(tokens, drafted=True)
    assert [n.page for n in path] == [4, 5]
    # Held by a running request: an equally good copy is freed, the held page stays.
    assert cache.release([], tokens, [7, 8, 9], computed=12, drafted=12) == [7, 8, 3]
    cache.release(path, tokens, [4, 5], computed=8, drafted=8)
    assert [n.page for n in cache.match(tokens, drafted=True)] == [4, 5, 9]
    assert cache.num_pages == 3


def test_eviction_is_lru_and_never_touches_locked_pages() -> None:
    cache = PrefixCache(PS)
    a, b = [1] * 8 + [2], [3] * 8 + [4]
    cache.release([], a, [10, 11], computed=8)
    cache.release([], b, [20, 21], computed=8)
    locked = cache.match(a)  # a is in use and the most recent
    assert cache.locked_pages == 2 and cache.evictable_pages == 2  # a's pages are in use
    assert cache.evict(10) == [21, 20]  # b's leaf first, then its parent; a is locked
    assert cache.num_pages == 2
    cache.release(locked, a, [10, 11], computed=8)
    assert sorted(cache.flush()) == [10, 11] and cache.num_pages == 0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")


SHARED = [5, 7, 9, 11, 13, 3, 4, 8, 6, 2, 12, 14, 15]


def _prompts() -> list[list[int]]:
    return [SHARED + [20, 21], SHARED + [30], SHARED[:9] + [40, 41, 42], SHARED + [20, 21]]


def _reqs(temperature: float = 0.0) -> list:
    params = SamplingParams(max_new_tokens=12, temperature=temperature, ignore_eos=True, seed=1)
    return [make_request(f"r{i}", p, params) for i, p in enumerate(_prompts())]


def test_outputs_unchanged_by_prefix_hits(ckpt: Path) -> None:
    ref = run_all(build_engine(ckpt, disable_radix_cache=True), _reqs())
    engine = build_engine(ckpt)
    first = run_all(engine, _reqs()[:1])  # fills the cache with the shared prefix
    assert first[0] == ref[0]
    reqs = _reqs()
    assert run_all(engine, reqs) == ref
    assert reqs[0].stats["cached_tokens"] >= 12 and reqs[2].stats["cached_tokens"] == 8
    stats = engine.scheduler.cache.stats
    assert 0 < stats.hit_rate < 1


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wide enough (k = 512) that two summation orders of a row seldom round alike."""
    return make_checkpoint(tmp_path_factory.mktemp("m") / "wide", "llama", hidden=512,
                           intermediate=1024, heads=8, kv_heads=4)


def test_long_prompt_logprobs_bit_equal_on_a_hit(wide: Path) -> None:
    """bf16, a prompt of several chunks' worth of rows: the first run computes it in 64-row
    chunks, a hit recomputes only its last page in a small step. Every token's
    log-probability is bit-equal to the run without the cache: each projection row rounds the
    same whatever rows share its call (ATen's oneDNN gemm used to take the steps above 16 rows
    on AVX512-BF16 CPUs and above 8 on AMX ones, and a hit's tail then differed in bits)."""
    prompt = [(7 * i + 3) % 90 + 5 for i in range(150)]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)

    def logprobs(engine) -> list[list[float]]:  # type: ignore[no-untyped-def]
        reqs = [make_request(f"r{i}", prompt, params) for i in range(2)]
        run_all(engine, reqs[:1])
        run_all(engine, reqs[1:])  # a hit on every full page but the last
        return [[lp for _, lp, _ in r.logprobs] for r in reqs]

    kw = {"dtype": "bfloat16", "pages": 128, "context_length": 256}
    ref = logprobs(build_engine(wide, disable_radix_cache=True, **kw))
    engine = build_engine(wide, **kw)
    got = logprobs(engine)
    assert engine.scheduler.cache.stats.hit_rate > 0
    assert got == ref and ref[0] == ref[1]


def test_sampled_outputs_unchanged_by_prefix_hits(ckpt: Path) -> None:
    ref = run_all(build_engine(ckpt, disable_radix_cache=True), _reqs(1.0))
    engine = build_engine(ckpt)
    run_all(engine, _reqs(1.0))
    assert run_all(engine, _reqs(1.0)) == ref


def test_preemption_and_eviction_with_a_small_pool(ckpt: Path) -> None:
    ref = run_all(build_engine(ckpt, disable_radix_cache=True), _reqs())
    engine = build_engine(ckpt, pages=14)  # 13 usable pages: requests preempt and evict
    for _ in range(2):
        assert run_all(engine, _reqs()) == ref
    sched = engine.scheduler
    assert sched.preemptions > 0
    sched.flush_cache()
    assert sched.allocator.num_free == sched.allocator.num_usable


def test_aborts_return_every_page(ckpt: Path) -> None:
    engine = build_engine(ckpt)
    sched = engine.scheduler
    for round_ in range(3):
        reqs = _reqs()
        for r in reqs:
            sched.add(r)
        for _ in range(3 + round_):
            engine.step(sched.next_batch())
        for r in reqs[::2]:
            sched.abort(r.rid)
        while sched.has_work():
            engine.step(sched.next_batch())
    assert sched.allocator.num_free + sched.cache.num_pages == sched.allocator.num_usable
    sched.flush_cache()
    assert sched.allocator.num_free == sched.allocator.num_usable


def _spec_generate(arg: tuple) -> list[list[int]]:
    """Two rounds of prompts sharing a prefix in one engine; the second round's outputs
    (its requests start on cached pages, target and draft KV alike)."""
    from tests.spec_helpers import args_for
    from tpserve.offline import OfflineEngine

    target, draft, cache = arg
    engine = OfflineEngine(args_for(target, draft, 3, 1, 4, disable_radix_cache=not cache))
    if engine.built.info.rank != 0:
        engine.follow()
        return []
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[1] + SHARED * 2 + [i + 2] for i in range(4)]
    engine.generate(prompts, params)
    before = engine.engine.scheduler.cache.stats.hit_tokens if cache else 0
    outs = engine.generate(prompts, params)
    if cache:  # the second round reused the first's pages (draft KV marked as written)
        hits = engine.engine.scheduler.cache.stats.hit_tokens - before
        assert hits >= 4 * (len(prompts[0]) // PS - 1) * PS, hits
    engine.close()
    return [o.output_ids for o in outs]


@pytest.fixture(scope="module")
def spec_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tests.eagle_checkpoints import make_draft

    root = tmp_path_factory.mktemp("spec")
    target = make_checkpoint(root / "target", "llama", layers=4, hidden=64, vocab=32)
    return target, make_draft(root / "draft", target, draft_ids=[0, 3, 5, 8, 13, 21, 30])


def test_speculative_outputs_unchanged_by_prefix_hits(spec_pair: tuple[Path, Path]) -> None:
    from tests.spec_helpers import run_tp

    target, draft = spec_pair
    ref = _spec_generate((target, None, False))
    assert _spec_generate((target, draft, True)) == ref
    assert run_tp(2, _spec_generate, (target, draft, True)) == ref


def test_cached_pages_keep_the_feature_a_hit_drafts_from(spec_pair: tuple[Path, Path]) -> None:
    """A request starting on cached pages seeds its draft with the stored feature of the last
    cached position: it must equal the feature the target computes there from scratch."""
    import numpy as np

    from tests.spec_helpers import args_for
    from tpserve.engine.plan import Layout
    from tpserve.offline import OfflineEngine

    target, draft = spec_pair
    prompt = [1] + SHARED * 2
    hot = OfflineEngine(args_for(target, draft, 3, 1, 4))
    hot.generate([prompt], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    pages = [n.page for n in hot.engine.scheduler.cache.match(prompt + [2])]
    assert len(pages) == len(prompt) // PS

    cold = OfflineEngine(args_for(target, draft, 3, 1, 4))
    drafter = cold.spec.drafter
    n = len(prompt)
    table = np.arange(1, 1 + -(-n // PS), dtype=np.int32)[None]
    out = drafter.runner.forward(
        Layout(np.array(prompt), np.array([n], np.int32), np.array([0], np.int32), table),
        [n - 1], drafter.aux_sorted)
    feats = drafter._features(out.aux)
    for i, page in enumerate(pages):
        stored = hot.spec.drafter.page_features[page]
        assert torch.allclose(stored, feats[(i + 1) * PS - 1], atol=1e-5), i


@pytest.mark.parametrize("mixed", [False, True])
def test_scheduler_reuses_only_drafted_pages_for_a_followed_request(mixed: bool) -> None:
    """Both batch builders (prompt-only and mixed) pass the 'will be followed' flag to the
    prefix match: a request the draft will follow must not reuse pages without draft KV."""
    from tpserve.engine.kv_cache import PageAllocator
    from tpserve.engine.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(PS, 4, 64, 200), PageAllocator(32))
    prompt = list(range(10, 23))  # 3 full pages and one token over
    sched.cache.release([], prompt, sched.allocator.alloc(3), computed=12, drafted=0)
    params = SamplingParams(max_new_tokens=4)
    for drafted, hit in ((True, 0), (False, 12)):
        req = make_request(f"r{drafted}", prompt, params)
        sched.add(req)
        batch = sched.next_batch(mixed=mixed, drafted=drafted)
        assert batch is not None and batch.requests == [req]
        assert req.cached_prefix == hit
        sched.finish(req, "done")
