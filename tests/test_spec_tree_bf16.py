"""In bf16 a draft tree gives greedy output identical to plain decoding, like a chain.

The native attention sums a chunk's keys by lane, and lanes follow positions. A tree node off
the first branch sits at a later slot during verify than its token gets when decoded one by
one (node 2 at depth 1 is at slot L + 2, sequential decoding puts that token at L + 1), so
summed at its slot its attention, and the KV of the layers above, differed from plain
decoding's in the last bits and a near-tie flipped the greedy pick (this prompt, from its
16th new token). attn_rows.h's tree_tail walks each tree query's keys at their sequential
positions. fp32 never showed it; bf16 rounds every op and ties are common.
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
def test_bf16_tree_greedy_equals_plain() -> None:
    torch.set_num_threads(1)
    target = Path(demo_target())
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    prompt = eval_prompts(tok, heldout_files(target, 0)[1], 16, seed=7)[10]
    tree = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(demo_draft()),
                speculative_num_steps=4, speculative_eagle_topk=2,
                speculative_num_draft_tokens=8, speculative_adaptive="off")
    assert _greedy(tree, prompt) == _greedy({}, prompt)
