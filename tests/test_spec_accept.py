"""Acceptance rules (crafted logits), accept statistics end to end, lossless sampling."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft, zero_final_norm
from tests.spec_helpers import args_for
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine
from tpserve.spec.verify import accept_greedy, accept_sampled

# Tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}
TOKENS = [9, 1, 2, 3, 4]
PARENTS = [-1, 0, 0, 1, 2]


def one_hot_rows(best: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(best), vocab)
    logits[torch.arange(len(best)), torch.tensor(best)] = 5.0
    return logits


def test_greedy_accepts_longest_matching_path() -> None:
    # target argmax: root -> 2 (node 2), node 2 -> 4 (node 4), node 4 -> 5 (bonus)
    acc = accept_greedy(TOKENS, PARENTS, one_hot_rows([2, 0, 4, 0, 5]))
    assert acc.nodes == [0, 2, 4] and acc.tokens == [2, 4, 5]
    acc = accept_greedy(TOKENS, PARENTS, one_hot_rows([5, 0, 0, 0, 0]))
    assert acc.nodes == [0] and acc.tokens == [5]


def test_recursive_rejection_is_lossless() -> None:
    p = torch.tensor([0.1, 0.3, 0.2, 0.15, 0.25, 0.0])
    probs = p.expand(5, 6).clone()
    gen = torch.Generator().manual_seed(0)
    n = 20000
    first = Counter(accept_sampled(TOKENS, PARENTS, probs, gen).tokens[0] for _ in range(n))
    emp = torch.tensor([first[i] / n for i in range(6)])
    assert torch.allclose(emp, p, atol=0.015), emp


@pytest.fixture(scope="module")
def const_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = make_checkpoint(tmp_path_factory.mktemp("const") / "t", "llama", layers=4,
                             vocab=32)
    zero_final_norm(target)  # greedy output is always token 0
    return target


@pytest.mark.parametrize("draft_token,expected", [(0, 4.0), (5, 1.0)])
def test_accept_length_end_to_end(const_target: Path, draft_token: int, expected: float,
                                  tmp_path: Path) -> None:
    torch.set_num_threads(1)
    draft = make_draft(tmp_path / "d", const_target, draft_ids=[draft_token])
    engine = OfflineEngine(args_for(const_target, draft, 3, 1, 4))
    params = SamplingParams(max_new_tokens=13, temperature=0.0, ignore_eos=True)
    outs = engine.generate([[1, 4, 6], [1, 2, 3, 4, 5, 6, 7]], params)
    spec = engine.spec.snapshot()
    assert spec["avg_accept_length"] == expected
    for out in outs:
        assert out.output_ids == [0] * 13
        steps = 3 if expected == 4.0 else 12  # 1 prefill token + 12 from verify steps
        assert out.meta["spec_verify_ct"] == steps
        assert out.meta["spec_accept_length"] == 13 / steps
        hist = out.meta["spec_accept_histogram"]
        assert hist[-1] == steps and len(hist) == (4 if expected == 4.0 else 1)
    assert spec["position_accept_rate"] == ([1.0] * 3 if expected == 4.0 else [0.0] * 3)


def _chi2(a: Counter, b: Counter) -> tuple[float, int]:
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat, bins, small_a, small_b = 0.0, 0, 0, 0
    for k in keys:
        if a[k] + b[k] < 10:  # pool sparse categories
            small_a, small_b = small_a + a[k], small_b + b[k]
            continue
        cells = [(a[k], b[k])]
        stat += _cell(cells[0], na, nb)
        bins += 1
    if small_a + small_b:
        stat += _cell((small_a, small_b), na, nb)
        bins += 1
    return stat, bins - 1


def _cell(pair: tuple[int, int], na: int, nb: int) -> float:
    total = pair[0] + pair[1]
    ea, eb = total * na / (na + nb), total * nb / (na + nb)
    return (pair[0] - ea) ** 2 / ea + (pair[1] - eb) ** 2 / eb


CHI2_999 = {d: v for d, v in enumerate([0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32,
                                        26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70])}


def test_sampling_matches_plain_distribution(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    target = make_checkpoint(tmp_path / "t", "llama", layers=4, vocab=16, seed=5)
    draft = make_draft(tmp_path / "d", target, mimic=True, draft_ids=[0, 3, 5, 7, 9, 11])
    n = 400
    prompt = [1, 4, 9, 3]

    def run(spec: bool, seed0: int) -> tuple[list[list[int]], OfflineEngine]:
        args = args_for(target, draft if spec else None, 2, 2, 4, max_running_requests=n)
        engine = OfflineEngine(args)
        params = [SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True,
                                 seed=seed0 + i) for i in range(n)]
        return [o.output_ids for o in engine.generate([prompt] * n, params)], engine

    plain, _ = run(False, 0)
    spec, engine = run(True, 10**6)
    assert engine.spec.snapshot()["accepted_drafts"] > 0
    for pos in (1, 2, 3):
        stat, dof = _chi2(Counter(o[pos] for o in plain), Counter(o[pos] for o in spec))
        assert stat < CHI2_999[dof], (pos, stat, dof)
