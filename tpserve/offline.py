"""In-process, synchronous generation: the whole engine without HTTP or threads.

``OfflineEngine(args)`` is built by the same ``build_engine`` as the server (TP = 1, or one
rank of an already initialised process group). Rank 0 calls ``generate``; other ranks call
``follow()`` and return when rank 0 calls ``close()``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tokenizers import Tokenizer, models

from tpserve.args import ServerArgs
from tpserve.engine.build import BuiltEngine, build_engine
from tpserve.engine.engine import Engine
from tpserve.engine.request import Request, RequestOutput, new_request
from tpserve.engine.sampling_params import SamplingParams
from tpserve.engine.warmup import run_to_completion
from tpserve.serve import eos_ids


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Token i <-> word "w{i}" (decoded space-separated): for checkpoints without one."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    return Tokenizer(models.WordLevel(vocab, unk_token="w0"))


class OfflineEngine:
    def __init__(self, args: ServerArgs, tokenizer: Tokenizer | None = None) -> None:
        self.built: BuiltEngine = build_engine(args)
        self.args = args = self.built.args
        tok_file = Path(args.tokenizer or self.built.model_dir) / "tokenizer.json"
        self.tokenizer = tokenizer or (Tokenizer.from_file(str(tok_file)) if tok_file.is_file()
                                       else word_tokenizer(self.built.cfg.vocab_size))
        self.eos = eos_ids(self.built.model_dir, self.built.cfg)
        self._ids = itertools.count()

    @property
    def engine(self) -> Engine:
        assert self.built.engine is not None, "only rank 0 has the engine"
        return self.built.engine

    @property
    def spec(self):  # type: ignore[no-untyped-def]
        return self.built.spec

    def follow(self) -> None:
        """Non-zero ranks: mirror rank 0 until it calls ``close``."""
        self.built.follow()

    def request(self, prompt: list[int], params: SamplingParams,
                sink: dict[str, RequestOutput]) -> Request:
        index = next(self._ids)
        return new_request(f"offline-{index}", prompt, params, self.tokenizer, self.eos,
                           self.args.seed + index, lambda out: sink.__setitem__(out.rid, out),
                           self.built.runner.device)

    def generate(self, prompts: list[list[int]],
                 params: list[SamplingParams] | SamplingParams) -> list[RequestOutput]:
        """Run ``prompts`` to completion together (continuous batching); outputs in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        sink: dict[str, RequestOutput] = {}
        reqs = [self.request(p, sp, sink) for p, sp in zip(prompts, params, strict=True)]
        run_to_completion(self.engine, reqs)
        return [sink[r.rid] for r in reqs]

    def close(self) -> None:
        self.built.shutdown_followers()
