"""Greedy speculative decoding is token-identical to plain greedy decoding (TP = 1 and 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tests.spec_helpers import args_for, run_tp
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine

SETTINGS = [(3, 1, 4), (3, 2, 6), (2, 4, 8)]  # (steps, topk, draft tokens)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = make_checkpoint(root / "target", "llama", layers=4, hidden=64, vocab=32)
    mimic = make_draft(root / "mimic", target, mimic=True)
    sub = make_draft(root / "sub", target, draft_ids=[0, 3, 5, 8, 13, 21, 30], seed=3)
    return target, mimic, sub


def prompts_and_params() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[1] + [(7 * i + 3 * j) % 31 + 1 for j in range(2 + 3 * i)] for i in range(8)]
    params = [SamplingParams(max_new_tokens=6 + 5 * (i % 4), temperature=0.0, ignore_eos=i % 2 == 0,
                             stop=("w7 w7",) if i == 3 else ()) for i in range(8)]
    return prompts, params


def generate(arg: tuple) -> list[tuple[list[int], str, dict]]:
    target, draft, setting, batch, *extra = arg
    steps, topk, tokens = setting
    engine = OfflineEngine(args_for(target, draft, steps, topk, tokens, **(extra or [{}])[0]))
    if engine.built.info.rank != 0:
        engine.follow()
        return []
    prompts, params = prompts_and_params()
    outs = engine.generate(prompts[:batch], params[:batch])
    engine.close()
    return [(o.output_ids, o.text, o.finish_reason) for o in outs]


def test_tp1_batch1_and_batch8(ckpts: tuple[Path, Path, Path]) -> None:
    torch.set_num_threads(1)
    target, mimic, sub = ckpts
    ref = generate((target, None, SETTINGS[0], 8))
    assert generate((target, None, SETTINGS[0], 1)) == ref[:1]
    for setting in SETTINGS:
        for draft in (mimic, sub):
            assert generate((target, draft, setting, 1)) == ref[:1], setting
            assert generate((target, draft, setting, 8)) == ref, setting


def test_tp2_chain_and_tree(ckpts: tuple[Path, Path, Path]) -> None:
    target, mimic, sub = ckpts
    ref = generate((target, None, SETTINGS[0], 8))
    assert run_tp(2, generate, (target, mimic, SETTINGS[0], 8)) == ref
    assert run_tp(2, generate, (target, sub, SETTINGS[1], 8)) == ref
    # The draft sharded like the target (--speculative-draft-tp 2) drafts the same trees.
    sharded = {"speculative_draft_tp": 2}
    assert run_tp(2, generate, (target, sub, SETTINGS[1], 8, sharded)) == ref


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_match_plain_decoding(ckpts: tuple[Path, Path, Path], top: int) -> None:
    """Each appended token's log-probability (and its top alternatives) is what plain greedy
    decoding reports for it: with no top logprobs asked, acceptance reads them from one fused
    argmax + logsumexp over all nodes, otherwise from a log-softmax per accepted node."""
    torch.set_num_threads(1)
    target, mimic, sub = ckpts
    prompts, _ = prompts_and_params()
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=top)
              for _ in prompts]

    def run(draft: Path | None) -> list:
        engine = OfflineEngine(args_for(target, draft, 3, 2, 6))
        outs = engine.generate(prompts, params)
        engine.close()
        return [(o.output_ids, o.logprobs) for o in outs]

    ref = run(None)
    for draft in (mimic, sub):
        got = run(draft)
        for (ids, lps), (ref_ids, ref_lps) in zip(got, ref, strict=True):
            assert ids == ref_ids and len(lps) == len(ref_lps) == len(ids)
            for (tok, lp, alts), (ref_tok, ref_lp, ref_alts) in zip(lps, ref_lps, strict=True):
                assert tok == ref_tok and lp == pytest.approx(ref_lp, abs=1e-5)
                assert (alts is None) == (ref_alts is None) == (top == 0)
                if alts is not None:
                    assert [t for t, _ in alts] == [t for t, _ in ref_alts]
                    assert [v for _, v in alts] == pytest.approx([v for _, v in ref_alts],
                                                                 abs=1e-5)
