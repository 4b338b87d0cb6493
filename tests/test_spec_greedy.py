"""Greedy speculative decoding is token-identical to plain greedy decoding (TP = 1 and 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from tests.checkpoints import make_checkpoint
from tests.eagle_checkpoints import make_draft
from tests.spec_helpers import args_for, run_tp
from tpserve.demo import demo_draft, demo_target
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
    # Request 5 biases two tokens: its verify rows go through the per-node penalties, not
    # the raw argmax, and must still give what plain decoding gives.
    params = [SamplingParams(max_new_tokens=6 + 5 * (i % 4), temperature=0.0, ignore_eos=i % 2 == 0,
                             stop=("w7 w7",) if i == 3 else (),
                             logit_bias=((7, 3.0), (11, -2.0)) if i == 5 else ())
              for i in range(8)]
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
    # The draft sharded like the target (--speculative-draft-tp 2) drafts the same trees, and
    # so does every rank drafting its own copy (auto on CPU: only the last rank drafts).
    for extra in ({"speculative_draft_tp": 2}, {"speculative_draft_ranks": "all"}):
        assert run_tp(2, generate, (target, sub, SETTINGS[1], 8, extra)) == ref


def generate_one_drafting(arg: tuple) -> dict:
    """``generate`` at TP = 2 with one drafting rank, plus what rank 0 saw of the draft (and
    in ``side``, what rank 1's drafter counted)."""
    target, draft, mode, side, setting, batch = arg
    engine = OfflineEngine(args_for(target, draft, *setting, speculative_draft_ranks=mode))
    drafter = engine.spec.drafter
    if engine.built.info.rank != 0:
        engine.follow()
        (side / "trees.json").write_text(json.dumps(drafter.trees))
        (side / "trees_sent.json").write_text(json.dumps(drafter._trees_sent))
        return {}
    comm = engine.built.runner.comm
    comm.set_profiling(True)
    prompts, params = prompts_and_params()
    outs = engine.generate(prompts[:batch], params[:batch])
    engine.close()
    phases = {}
    for snap in comm.stats().values():
        for phase, entry in snap["by_phase"].items():
            phases[phase] = phases.get(phase, 0) + entry["calls"]
    return {"outputs": [(o.output_ids, o.text, o.finish_reason) for o in outs],
            "drafts": drafter.drafts, "rank": drafter.drafting_rank,
            "draft_kv": float(sum(t.abs().sum() for t in drafter.draft_kv.pools)),
            "spec": engine.spec.snapshot(), "phases": phases}


# One request at (2, 4, 8): the verify reaches further than the draft, so the assumed page
# table often covers the guess's draft but not its verify layout (built only where it does).
@pytest.mark.parametrize("setting, batch, draft", [(SETTINGS[1], 8, "sub"),
                                                   (SETTINGS[2], 1, "mimic")])
def test_tp2_one_drafting_rank_hands_the_tree_over(ckpts: tuple[Path, Path, Path],
                                                   tmp_path: Path,
                                                   setting: tuple[int, int, int],
                                                   batch: int, draft: str) -> None:
    """Rank 1 drafts alone: rank 0 never runs the draft (its draft KV stays zero), gets every
    tree through one allreduce a step (none in the draft phase) and decodes exactly as plain
    greedy, accepting exactly what every rank drafting its own copy accepts (the same trees:
    a lost tree would still verify losslessly, but accept nothing). Rank 1 grows most trees
    ahead, before rank 0's commit and plan arrive; the rest (a request finished, a page the
    guess could not be sure of) it grows again from the real plan."""
    target, mimic, sub = ckpts
    drafter = {"sub": sub, "mimic": mimic}[draft]
    ref = generate((target, None, SETTINGS[0], batch))
    got = run_tp(2, generate_one_drafting, (target, drafter, "one", tmp_path, setting, batch))
    ahead = json.loads((tmp_path / "trees.json").read_text())
    sent = json.loads((tmp_path / "trees_sent.json").read_text())
    every = run_tp(2, generate_one_drafting, (target, drafter, "all", tmp_path, setting, batch))
    assert got["outputs"] == every["outputs"] == ref
    assert got["rank"] == 1 and not got["drafts"] and got["draft_kv"] == 0.0
    assert every["rank"] is None and every["drafts"] and every["draft_kv"] > 0.0
    spec, trees = dict(got["spec"]), got["spec"]["draft_trees"]
    # Rank 0 grew none itself; it reports rank 1's counts as of the last tree handed over.
    assert trees == sent, (trees, sent)
    assert trees["native"] + trees["loop"] > 0 and sum(every["spec"]["draft_trees"].values()) > 0
    # Rank 1: every step's tree was either grown ahead and used, or grown from the plan.
    assert ahead["ahead"] > ahead["ahead_wasted"] and ahead["ahead"] > 0
    # Most of those plans rank 0 confirmed with a bare "as guessed" (TP = 2: rank 1 is the
    # only follower); the others came in full and were checked here.
    assert 0 < ahead["guessed"] <= ahead["ahead"]
    assert ahead["native"] + ahead["loop"] == spec["steps"] + ahead["ahead_wasted"]
    assert spec.pop("drafting_rank") == 1 and every["spec"]["drafting_rank"] is None
    spec.pop("draft_trees")
    assert spec == {k: v for k, v in every["spec"].items()
                    if k not in ("draft_trees", "drafting_rank")}
    assert spec["accepted_drafts"] > 0
    assert got["phases"].get("draft", 0) == 0 and got["phases"]["tree"] == spec["steps"]
    assert "tree" not in every["phases"] and every["phases"].get("draft", 0) == 0


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



def generate_long(arg: tuple) -> dict:
    """The demo pair (a trained draft, accepted several tokens a step): one greedy request
    of ``new`` tokens on pages of ``page_size``, plain decoding when ``setting`` is None;
    speculating at TP = 2, one rank drafts and its drafter counts go to ``side``."""
    setting, new, page_size, side = arg
    spec = () if setting is None else (demo_draft(), *setting)
    engine = OfflineEngine(args_for(demo_target(), *spec, page_size=page_size))
    if engine.built.info.rank != 0:
        engine.follow()
        (side / "trees.json").write_text(json.dumps(engine.spec.drafter.trees))
        return {}
    prompt = Tokenizer.from_file(str(demo_target() / "tokenizer.json")).encode(
        "def fibonacci(n):").ids
    out = engine.generate([prompt], [SamplingParams(max_new_tokens=new, temperature=0.0,
                                                    ignore_eos=True)])[0]
    steps = engine.spec.snapshot()["steps"] if engine.spec is not None else 0
    engine.close()
    return {"ids": out.output_ids, "steps": steps}


def test_tp2_drafting_rank_runs_ahead_across_pages(tmp_path: Path) -> None:
    """The scheduler keeps the next step's slots ahead of each request
    (``SpecConfig.reserve``), so the drafting rank grows every tree but the first before
    rank 0's plan arrives, and builds every verify layout but the first ahead too, even
    where a step crosses into a new page (2-token pages: every step does). With only the
    step's own lookahead reserved, a step whose next tree reached an unallocated page had
    that tree grown after the plan instead, and a newly added page voided the layout built
    ahead. Greedy output stays plain decoding's."""
    ref = generate_long((None, 48, 2, tmp_path))
    got = run_tp(2, generate_long, ((4, 2, 8), 48, 2, tmp_path))
    trees = json.loads((tmp_path / "trees.json").read_text())
    assert got["ids"] == ref["ids"] and len(ref["ids"]) == 48
    steps = got["steps"]
    assert steps < 24, steps  # the draft is accepted: the tree reaches past the verify's pages
    assert trees["ahead"] == trees["ahead_layout"] == trees["guessed"] == steps - 1, trees
    # At most one tree wasted: the one grown after the last step, for a step that never came.
    assert trees["ahead_wasted"] <= 1, trees
    assert trees["native"] + trees["loop"] == steps + trees["ahead_wasted"], trees
