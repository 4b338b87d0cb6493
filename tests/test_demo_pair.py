"""The shipped demo pair: it loads, speculation is lossless on it, and the draft is useful."""

from __future__ import annotations

import ast

import pytest
import torch

from tpserve.args import ServerArgs
from tpserve.demo import demo_draft, demo_target, with_demo_defaults
from tpserve.engine.sampling_params import SamplingParams
from tpserve.offline import OfflineEngine

PROMPTS = ("def ", "import ", "class ", "    for i in range(")
NEW_TOKENS = 48
BASE = dict(device="cpu", dtype="float32", allreduce="gloo", cpu_threads=1,
            max_total_tokens=2048, context_length=512)


def _run(spec: bool) -> tuple[list[list[int]], list[float], OfflineEngine]:
    extra = dict(speculative_algorithm="EAGLE3") if spec else {}
    engine = OfflineEngine(ServerArgs(**BASE, **extra))  # type: ignore[arg-type]
    prompts = [engine.tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    engine.close()
    return [o.output_ids for o in outs], [o.meta.get("spec_accept_length", 1.0) for o in outs], engine


@pytest.fixture(scope="module")
def runs() -> tuple[tuple, tuple]:
    torch.set_num_threads(1)
    return _run(False), _run(True)


def test_pair_is_packaged_and_small() -> None:
    size = sum(f.stat().st_size for d in (demo_target(), demo_draft()) for f in d.iterdir())
    assert size < 20 * 2**20
    args = with_demo_defaults(ServerArgs(speculative_algorithm="EAGLE3"))
    assert args.speculative_draft_model_path == str(demo_draft())


def test_speculative_greedy_equals_plain_greedy(runs: tuple[tuple, tuple]) -> None:
    (plain, _, engine), (spec, _, _) = runs
    assert spec == plain
    text = engine.tokenizer.decode(plain[0])
    assert text.strip(), "the demo target should write something"


def _parses(line: str) -> bool:
    """A complete statement, or the header of a compound one (``def f(x):``, ``class A(B):``)."""
    for source in (line, line + "\n    pass"):
        try:
            ast.parse(source)
            return True
        except SyntaxError:
            pass
    return False


def _statement_lines(text: str) -> list[str]:
    """Lines that Python parses on their own and that say something (not just a name)."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if len(line) >= 8 and not line.startswith("#")
            and any(c in line for c in "(=.:") and _parses(line)]


def test_target_writes_python(runs: tuple[tuple, tuple]) -> None:
    """Greedy after `def `, `import ` and `class `: a name, then lines Python itself parses."""
    (plain, _, engine), _ = runs
    for prompt, ids in zip(PROMPTS[:3], plain[:3]):
        text = engine.tokenizer.decode(ids)
        name = text.split("(")[0].split(":")[0].split("\n")[0].split(".")[0].strip()
        assert name.isidentifier(), (prompt, text)
        assert _statement_lines(prompt + text), (prompt, text)


def test_one_token_prompt_alone_in_a_batch() -> None:
    """A prefill step whose only prompt is one token leaves the draft nothing to extend."""
    torch.set_num_threads(1)
    outs = []
    for extra in ({}, {"speculative_algorithm": "EAGLE3"}):
        engine = OfflineEngine(ServerArgs(**BASE, **extra))  # type: ignore[arg-type]
        ids = engine.tokenizer.encode("return", add_special_tokens=False).ids
        assert len(ids) == 1
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        outs.append(engine.generate([ids], params)[0].output_ids)
        engine.close()
    assert outs[1] == outs[0] and len(outs[0]) == 12


def test_draft_is_accepted(runs: tuple[tuple, tuple]) -> None:
    _, (_, accept, _) = runs
    assert sum(accept) / len(accept) > 1.5, accept
