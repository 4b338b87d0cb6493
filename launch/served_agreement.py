"""Do tpserve and llama.cpp compute the same model? Greedy tokens of both on the same prompts.

The benchmark's vocabulary is one character per token (``launch.gguf_export.vocabulary``), so
a random prompt written as text tokenizes to the same ids in llama.cpp's ``llama-simple`` (BOS
first) as the ids tpserve is given (``[BOS, *ids]``). Both decode greedily; the report counts
how many leading tokens agree. bf16 weights in two different kernels round differently, and
random weights give flat logits, so a late divergence is expected; a wrong weight layout
(e.g. the rotary permutation) disagrees from the first token.
"""

from __future__ import annotations

import random

import httpx

from launch.gguf_export import vocabulary
from launch.llamacpp_output import parse_simple_tokens
from launch.llamacpp_tools import LlamaCpp
from launch.served_client import random_ids

BOS = 1


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y or x < 0:
            break
        n += 1
    return n


def check(url: str, llama: LlamaCpp, vocab_size: int, prompts: int = 4, prompt_len: int = 16,
          tokens: int = 16, seed: int = 0) -> dict[str, object]:
    vocab = vocabulary(vocab_size)
    rng = random.Random(seed)
    cases = []
    for _ in range(prompts):
        ids = random_ids(rng, prompt_len, vocab_size)
        text = "".join(vocab[i] for i in ids)
        theirs = parse_simple_tokens(llama.greedy(text, tokens), text, vocab)[:tokens]
        body = {"input_ids": [BOS, *ids],
                "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0,
                                    "ignore_eos": True}}
        ours = httpx.post(url + "/generate", json=body, timeout=300).json()["output_ids"]
        cases.append({"prompt": ids, "tpserve": ours, "llama.cpp": theirs,
                      "agree": leading_agreement(ours, theirs)})
    return {"tokens": tokens, "cases": cases,
            "summary": f"greedy tokens agreeing from the start: "
                       f"{', '.join(str(c['agree']) for c in cases)} of {tokens} "
                       f"({prompts} random prompts)"}
