"""In-process, synchronous generation: the whole engine without HTTP or threads.

``OfflineEngine(args)`` builds model, KV cache, scheduler and engine exactly as ``serve``
does (TP = 1, or one rank of an already initialised process group). Rank 0 calls
``generate``; other ranks call ``follow()`` and return when rank 0 calls ``close()``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tokenizers import Tokenizer, models

from tpserve.args import ServerArgs
from tpserve.control import make_channel
from tpserve.demo import with_demo_defaults
from tpserve.engine.engine import Engine, follow
from tpserve.engine.kv_cache import PageAllocator
from tpserve.engine.plan import StepPlan
from tpserve.engine.request import Request, RequestOutput, new_request
from tpserve.engine.sampling_params import SamplingParams
from tpserve.engine.scheduler import Scheduler, SchedulerConfig
from tpserve.engine.static_setup import install_static
from tpserve.engine.warmup import run_to_completion
from tpserve.layers.tp import TPContext
from tpserve.serve import eos_ids, setup_rank
from tpserve.spec.config import spec_config_from_args
from tpserve.spec.setup import build_spec


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """Token i <-> word "w{i}" (decoded space-separated): for checkpoints without one."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    return Tokenizer(models.WordLevel(vocab, unk_token="w0"))


class OfflineEngine:
    def __init__(self, args: ServerArgs, tokenizer: Tokenizer | None = None) -> None:
        args = with_demo_defaults(args)
        spec_cfg = spec_config_from_args(args)
        self.setup = setup = setup_rank(args)
        self.spec = None
        if spec_cfg is not None:
            tp = TPContext(setup.info.rank, setup.info.world_size, setup.comm)
            self.spec = build_spec(spec_cfg, str(args.speculative_draft_model_path),
                                   setup.runner, tp, setup.dtype, setup.context_length + 64)
        install_static(args, setup.runner, self.spec, setup.info.world_size,
                       setup.context_length)
        self.channel = make_channel(None) if setup.info.world_size > 1 else None
        self.args = args
        tok_file = Path(args.tokenizer or setup.model_dir) / "tokenizer.json"
        self.tokenizer = tokenizer or (Tokenizer.from_file(str(tok_file)) if tok_file.is_file()
                                       else word_tokenizer(setup.cfg.vocab_size))
        self.eos = eos_ids(setup.model_dir, setup.cfg)
        self._ids = itertools.count()
        if setup.info.rank != 0:
            return
        scheduler = Scheduler(
            SchedulerConfig(args.page_size, args.max_running_requests, args.chunked_prefill_size,
                            setup.context_length, spec_cfg.lookahead if spec_cfg else 0),
            PageAllocator(setup.runner.kv.cfg.num_pages))
        self.engine = Engine(setup.runner, scheduler, self.channel, setup.context_length,
                             self.spec)

    def follow(self) -> None:
        """Non-zero ranks: mirror rank 0 until it calls ``close``."""
        assert self.channel is not None
        follow(self.setup.runner, self.channel, self.spec)

    def request(self, prompt: list[int], params: SamplingParams,
                sink: dict[str, RequestOutput]) -> Request:
        index = next(self._ids)
        return new_request(f"offline-{index}", prompt, params, self.tokenizer, self.eos,
                           self.args.seed + index, lambda out: sink.__setitem__(out.rid, out))

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
        if self.setup.info.rank == 0:
            self.engine.broadcast(StepPlan(kind="shutdown"))
