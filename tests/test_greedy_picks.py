"""Greedy picks made in each rank's vocab shard (``ParallelLMHead.greedy``) equal greedy
sampling from the gathered logits: the same tokens, log-probabilities within rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tpserve.engine.engine as engine_module
from tests.checkpoints import make_checkpoint
from tests.spec_helpers import args_for, run_tp
from tpserve.engine.sampling_params import SamplingParams
from tpserve.layers import cpu_ops, fused
from tpserve.layers.fused import greedy_logprob_reference
from tpserve.offline import OfflineEngine


def picks_of(logits: torch.Tensor, world: int) -> tuple[list[int], torch.Tensor]:
    """Split ``logits`` [K, V] as the head shards the vocab (padded to a multiple of
    ``world``: the padding rows are zero, past ``valid``), pick in each shard and combine
    the sum of the shards' picks, as the ranks do. Row by row through a one-wide head
    (hidden [[1]]), so each weight is a logit exactly, infinities and NaN included."""
    cpu_ops.load()
    per_rank = -(-logits.shape[1] // world)
    one = torch.ones(1, 1)
    tokens, logprobs = [], []
    for row in logits:
        picks = torch.zeros(1, 3 * world)
        for r in range(world):
            shard = row[r * per_rank : (r + 1) * per_rank]
            weight = torch.zeros(per_rank, 1)
            weight[: len(shard), 0] = shard
            mine = torch.ops.tpserve.shard_pick(one, None, 0.0, weight, len(shard),
                                                r * per_rank, r, world)
            assert (mine[:, : 3 * r] == 0).all() and (mine[:, 3 * r + 3 :] == 0).all()
            picks += mine
        token, logprob = torch.ops.tpserve.combine_picks(picks, [])
        tokens.append(int(token))
        logprobs.append(float(logprob))
    return tokens, torch.tensor(logprobs)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("vocab", [37, 1000, 32000])
def test_shard_picks_equal_the_whole_vocab_pick(world: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab + world)
    logits = torch.randn(6, vocab, generator=gen) * 4
    per_rank = -(-vocab // world)
    second = min(per_rank + 2, vocab - 1)
    logits[1, 5] = logits[1, second] = logits[1].max() + 1  # a tie (across shards)
    logits[2, min(per_rank, vocab - 1) :] = float("-inf")  # whole shards masked out
    logits[3, vocab - 1] = logits[3].max() + 2  # the last id wins
    logits[4] *= 1e-4  # nearly flat: the log-sum-exp matters most
    tokens, logprobs = picks_of(logits, world)
    ref_tokens, ref_logprobs = greedy_logprob_reference(logits)
    assert tokens == ref_tokens.tolist()
    assert tokens[1] == 5
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-5, rtol=1e-6)
    exact = greedy_logprob_reference(logits.double())[1]
    assert torch.allclose(logprobs.double(), exact, atol=1e-5)
    if world == 1:  # one shard: the bits of greedy sampling from the logits
        assert logprobs.tolist() == fused.greedy_logprob(logits)[1].tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_non_finite_maxima_pick_as_argmax_and_report_the_lowest_float(world: int) -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    logits[0, 20] = logits[0, 25] = float("nan")  # the first NaN counts as the maximum
    logits[1, 7] = float("inf")
    logits[2, 12] = logits[2, 28] = float("inf")
    logits[3] = float("-inf")
    tokens, logprobs = picks_of(logits, world)
    ref_tokens, ref_logprobs = greedy_logprob_reference(logits)
    assert tokens == ref_tokens.tolist() == [20, 7, 12, 0]
    assert logprobs.tolist() == ref_logprobs.tolist() == [np.finfo(np.float32).min] * 4


def test_an_empty_shard_never_wins() -> None:
    """A small vocab over many ranks leaves the last shards empty (all padding)."""
    logits = torch.tensor([[-50.0, -60.0, -70.0]])
    tokens, logprobs = picks_of(logits, 4)  # per rank 1: shard 3 is empty
    assert tokens == [0]
    assert logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0].item(), abs=1e-6)


def _generate(arg: tuple) -> tuple[list, int, int]:
    """Greedy generation of a small batch: (per request (tokens, logprobs), how many times
    rank 0's head picked, how many plans it sent as ``AsGuessed``). ``picks`` False: rank 0
    never asks for picks (every rank then gathers logits and rank 0 samples from them)."""
    target, allreduce, picks, *page = arg
    engine = OfflineEngine(args_for(target, allreduce=allreduce, page_size=(page or [4])[0]))
    if engine.built.info.rank != 0:
        engine.follow()
        return [], 0, 0
    head, calls, guessed = engine.engine.runner.model.lm_head, [0], [0]
    confirm = engine_module.as_guessed

    def counted_guess(plan: Any) -> Any:
        guessed[0] += 1
        return confirm(plan)

    engine_module.as_guessed = counted_guess
    inner = head.greedy

    def counted(*args: object) -> tuple[list[int], list[float]]:
        calls[0] += 1
        return inner(*args)

    head.greedy = counted
    if not picks:
        engine.engine._picks_greedy = lambda sampling: False
    prompts = [[1] + [(5 * i + 3 * j) % 36 + 1 for j in range(2 + 7 * i)] for i in range(5)]
    params = [SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(5)]
    outs = engine.generate(prompts, params)
    engine.close()
    engine_module.as_guessed = confirm
    return [(o.output_ids, [lp for _, lp, _ in o.logprobs]) for o in outs], calls[0], guessed[0]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # An odd vocab: the second rank's shard ends in a padding row.
    return make_checkpoint(tmp_path_factory.mktemp("picks") / "t", "llama", layers=2,
                           hidden=64, vocab=37)


def test_one_rank_picks_the_bits_sampling_from_the_logits_gives(target: Path) -> None:
    torch.set_num_threads(1)
    ref, ref_calls, _ = _generate((target, "gloo", False))
    got, calls, guessed = _generate((target, "gloo", True))
    assert ref_calls == 0 and calls >= 18  # the longest request's decode steps at least
    assert guessed == 0  # no follower to tell
    assert got == ref


@pytest.mark.parametrize("allreduce", ["gloo", "shm"])
def test_tp2_greedy_steps_pick_in_shards_and_match_the_logits_path(target: Path,
                                                                    allreduce: str) -> None:
    torch.set_num_threads(1)
    ref, _, _ = _generate((target, "gloo", False))  # TP = 1, logits
    picked, calls, guessed = run_tp(2, _generate, (target, allreduce, True))
    gathered, gathered_calls, _ = run_tp(2, _generate, (target, allreduce, False))
    assert gathered_calls == 0 and calls >= 18
    # The follower ran some decode steps on its own guess (rank 0 confirming them), and the
    # rest (prompt steps, requests finishing or taking a new page every 4 tokens) from rank
    # 0's plan; with 16 tokens a page, more of them.
    assert 0 < guessed < calls
    paged, paged_calls, paged_guessed = run_tp(2, _generate, (target, allreduce, True, 16))
    assert paged_calls >= 18 and paged_guessed > guessed
    for (ids, lps), (p_ids, p_lps) in zip(picked, paged, strict=True):
        # Attention rounds by page, hence not the very bits of 4-token pages.
        assert p_ids == ids and p_lps == pytest.approx(lps, abs=1e-5)
    for (ids, lps), (ref_ids, ref_lps), (g_ids, g_lps) in zip(picked, ref, gathered,
                                                                strict=True):
        assert ids == ref_ids == g_ids
        assert lps == pytest.approx(g_lps, abs=1e-5)  # the same TP = 2 logits, two ways
        assert lps == pytest.approx(ref_lps, abs=1e-4)  # TP = 1 sums its layers otherwise
