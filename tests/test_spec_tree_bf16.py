"""Known bug, kept visible: in bf16 a draft *tree* can change greedy output (chains do not).

The native attention sums a chunk's keys by lane, and lanes follow cache slots. A tree node
that is not on the first branch sits at a later slot during verify than its token will when
decoded one by one (node 2 at depth 1 is at slot L + 2, sequential decoding puts that token
at L + 1), so its attention output, and the KV of the layers above, differ in the last bits
from plain decoding's; at a near-tie the greedy pick flips. fp32 and chains are unaffected.
Fixing it means walking a tree row's visible keys at their sequential positions. Remove the
xfail when that lands (strict: the test fails once it passes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from tpserve.args import ServerArgs
from tpserve.demo import demo_draft, demo_target
from tpserve.engine.sampling_params import SamplingParams
from tpserve.layers import cpu_ops
from tpserve.layers.attention import cpu_native
from tpserve.offline import OfflineEngine
from tpserve.train.corpus import heldout_files
from tpserve.train.evaluate import eval_prompts


def _greedy(spec: dict, prompt: list[int]) -> list[int]:
    args = ServerArgs(model=str(demo_target()), device="cpu", dtype="bfloat16", cpu_threads=1,
                      max_total_tokens=2048, context_length=512, **spec)
    engine = OfflineEngine(args)
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0,
                                                   ignore_eos=True))[0].output_ids
    engine.close()
    return out


@pytest.mark.skipif(cpu_ops.load().impl != "c++" or bool(cpu_native.load().reason),
                    reason="needs the native matmul and attention (the bf16 CPU fast path)")
@pytest.mark.xfail(strict=True, reason="bf16 tree verify is not bit-equal to sequential decode")
def test_bf16_tree_greedy_equals_plain() -> None:
    torch.set_num_threads(1)
    target = Path(demo_target())
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    prompt = eval_prompts(tok, heldout_files(target, 0)[1], 16, seed=7)[10]
    tree = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(demo_draft()),
                speculative_num_steps=4, speculative_eagle_topk=2,
                speculative_num_draft_tokens=8, speculative_adaptive="off")
    assert _greedy(tree, prompt) == _greedy({}, prompt)
