"""``python -m tpserve``: build this rank's engine, then serve HTTP (rank 0) or follow.

Rank 0 listens from the first second (503 with the start-up stage until ready), builds its
engine like every rank, warms it up, and hands the socket to the real app.
"""

from __future__ import annotations

import itertools
import logging
import threading
from pathlib import Path

from tokenizers import Tokenizer

from tpserve.args import ServerArgs
from tpserve.dist import rank_info
from tpserve.engine.build import BuiltEngine, build_engine, stage
from tpserve.engine.engine import Engine
from tpserve.engine.request import Request, new_request
from tpserve.engine.sampling_params import SamplingParams
from tpserve.engine.warmup import warm_up, warmup_shape
from tpserve.errors import ConfigError
from tpserve.generation_config import load_generation_config, stop_token_ids
from tpserve.heap import freeze_startup_heap
from tpserve.model_path import resolve_args
from tpserve.models.config import ModelConfig
from tpserve.preflight import check_server_args
from tpserve.server.lifecycle import finish_leader, run_follower
from tpserve.server.security import check_bind_security
from tpserve.server.startup_http import StartupResponder, bind_listener

log = logging.getLogger("tpserve")


def eos_ids(model_dir: Path, cfg: ModelConfig, generation_config: str = "auto") -> frozenset[int]:
    # [ckpt] config.json's and generation_config.json's EOS ids (tpserve.generation_config)
    return stop_token_ids(cfg.eos_token_ids, load_generation_config(model_dir, generation_config))


def load_tokenizer(path: Path) -> Tokenizer:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise ConfigError(f"no tokenizer.json in '{path}' (use --tokenizer)", "--tokenizer")
    return Tokenizer.from_file(str(file))


def run_warmup(built: BuiltEngine, engine: Engine, tokenizer: Tokenizer,
               eos: frozenset[int]) -> None:
    """Rank 0, before the engine thread starts: every rank follows the warm-up steps."""
    args = built.args
    shape = warmup_shape(args.max_running_requests, args.chunked_prefill_size,
                         built.context_length, built.runner.kv.cfg.max_tokens)
    ids = itertools.count()

    def make(prompt: list[int], params: SamplingParams) -> Request:
        index = next(ids)  # greedy: the seed is never used
        return new_request(f"warmup-{index}", prompt, params, tokenizer, eos, index,
                           lambda _: None, engine.device)

    seconds = warm_up(engine, make, shape, built.cfg.vocab_size)
    log.info("warm-up: %d requests (prompts of %d and %d tokens), %d new tokens each, %.2fs",
             shape.requests, shape.prompt_len, shape.long_prompt_len, shape.new_tokens, seconds)


def start_responder(args: ServerArgs) -> StartupResponder | None:
    """Rank 0 listens from the first second (503 until ready); other ranks serve no HTTP."""
    if rank_info(args.device).rank != 0:
        return None
    responder = StartupResponder(bind_listener(args.host, args.port)).start()
    log.info("listening on http://%s:%d (503 until ready)", args.host, args.port)
    return responder


def run(args: ServerArgs) -> int:
    args = resolve_args(args)  # [ckpt] --model / --tokenizer may be a HF cache dir or repo id
    # [ckpt] every rank refuses a checkpoint it cannot serve before the process group forms
    check_server_args(args, rank_info(args.device).world_size)
    check_bind_security(args)  # beyond loopback without a key: refused on every rank
    responder = start_responder(args)
    on_stage = responder.set_stage if responder is not None else (lambda _: None)
    built = build_engine(args, on_stage)
    args = built.args
    if built.engine is None:
        freeze_startup_heap()
        return run_follower(built.follow, built.channel, built.comm)
    from tpserve.server.app_main import serve_http

    engine = built.engine
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else built.model_dir)
    eos = eos_ids(built.model_dir, built.cfg, args.generation_config)
    if not args.skip_server_warmup:
        with stage("warm-up (largest prefill chunk and decode batch)", on_stage):
            run_warmup(built, engine, tokenizer, eos)
    if args.enable_profiling:
        engine.reconfigure({"profiling": True})
    thread = threading.Thread(target=engine.run, name="tpserve-engine", daemon=True)
    thread.start()
    assert responder is not None  # rank 0 always has one
    code = serve_http(args, built, engine, tokenizer, eos, thread, responder)
    return finish_leader(engine, thread, code, built.channel, built.comm)
