"""Start-up: distributed init, model + KV cache on every rank, then serve (rank 0) or follow.

Start-up logs each phase with its duration, so a slow start shows where its time went.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from comm_backends import BackendUnavailable
from tpserve.args import ServerArgs
from tpserve.control import make_channel
from tpserve.demo import demo_target, with_demo_defaults
from tpserve.dist import (
    CommSwitch,
    RankInfo,
    cpu_threads_per_rank,
    create_comm,
    init_process_group,
    rank_info,
)
from tpserve.engine.engine import Engine, follow
from tpserve.engine.kv_cache import KVCache, KVCacheConfig, PageAllocator
from tpserve.engine.request import Request, new_request
from tpserve.engine.runner import ModelRunner
from tpserve.engine.sampling_params import SamplingParams
from tpserve.engine.scheduler import Scheduler, SchedulerConfig
from tpserve.engine.static_setup import ModelShape, graph_reserve_bytes, install_static
from tpserve.engine.warmup import warm_up, warmup_shape
from tpserve.layers.tp import TPContext
from tpserve.loader import resolve_dtype
from tpserve.models.config import ModelConfig, load_config
from tpserve.models.registry import build_model
from tpserve.server.lifecycle import finish_leader, run_follower
from tpserve.server.startup_http import StartupResponder, bind_listener
from tpserve.spec.config import spec_config_from_args
from tpserve.spec.setup import build_spec

log = logging.getLogger("tpserve")


PhaseHook = Callable[[str], None]


def _no_hook(_: str) -> None:
    return None


@contextmanager
def phase(name: str, on_phase: PhaseHook = _no_hook):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    log.info("%s ...", name)
    on_phase(name)
    yield
    log.info("%s done in %.2fs", name, time.perf_counter() - start)


@dataclass
class RankSetup:
    info: RankInfo
    cfg: ModelConfig
    model_dir: Path
    comm: CommSwitch
    runner: ModelRunner
    context_length: int
    dtype: torch.dtype


def kv_budget_bytes(args: ServerArgs, info: RankInfo) -> int:
    if info.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(info.device)
        return max(0, int(total * args.mem_fraction_static) - (total - free))
    return int(args.kv_cache_gb * (1 << 30))


def agree_min(value: int, info: RankInfo) -> int:
    """Every rank must size the cache identically: take the minimum (a start-up decision)."""
    if info.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def make_kv(args: ServerArgs, cfg: ModelConfig, model: Any, info: RankInfo,
            dtype: torch.dtype, context_length: int) -> KVCache:
    layout = model.kv_layout()
    # CUDA graphs are captured after the KV cache exists: leave room for them first.
    reserve = graph_reserve_bytes(args, ModelShape.of(model, dtype), context_length, info.device)
    pages = KVCacheConfig.pages_for_budget(max(0, kv_budget_bytes(args, info) - reserve),
                                           args.page_size, layout, dtype)
    if args.max_total_tokens:
        pages = min(pages, -(-args.max_total_tokens // args.page_size) + 1)
    pages = agree_min(pages, info)
    if (pages - 1) * args.page_size < min(context_length, 2 * args.page_size):
        raise SystemExit(f"error: KV budget gives only {pages - 1} pages; raise --kv-cache-gb "
                         "or --mem-fraction-static")
    kv_cfg = KVCacheConfig(pages, args.page_size, layout, dtype)
    log.info("KV cache: %d pages x %d tokens (%.1f MB per rank)", pages, args.page_size,
             pages * args.page_size * kv_cfg.bytes_per_token / 1e6)
    return KVCache(kv_cfg, info.device)


def setup_rank(args: ServerArgs, on_phase: PhaseHook = _no_hook) -> RankSetup:
    info = rank_info(args.device)
    if info.device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(info.local_world_size, args.cpu_threads))
    init_process_group(info, args.dist_timeout_s)
    try:
        comm = create_comm(args.allreduce, info)
    except (BackendUnavailable, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    with phase("resolving model", on_phase):
        model_dir = Path(args.model) if args.model else demo_target()
        cfg = load_config(model_dir)
    context_length = min(args.context_length or cfg.max_position, cfg.max_position)
    dtype = resolve_dtype(args.dtype, cfg.torch_dtype, info.device)
    tp = TPContext(info.rank, info.world_size, comm)
    with phase(f"loading weights ({dtype})", on_phase):
        # Rotary tables reach past the context so speculative tree positions stay in range.
        model = build_model(model_dir, tp, dtype, info.device, context_length + 64, cfg)
    with phase("allocating KV cache", on_phase):
        kv = make_kv(args, cfg, model, info, dtype, context_length)
    runner = ModelRunner(model, kv, info.device, comm)
    return RankSetup(info, cfg, model_dir, comm, runner, context_length, dtype)


def eos_ids(model_dir: Path, cfg: ModelConfig) -> frozenset[int]:
    ids = set(cfg.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    return frozenset(ids)


def load_tokenizer(path: Path) -> Tokenizer:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise SystemExit(f"error: no tokenizer.json in '{path}' (use --tokenizer)")
    return Tokenizer.from_file(str(file))


def run_warmup(args: ServerArgs, setup: RankSetup, engine: Engine, tokenizer: Tokenizer,
               eos: frozenset[int]) -> None:
    """Rank 0, before the engine thread starts: every rank follows the warm-up plans."""
    kv_tokens = setup.runner.kv.cfg.num_pages * args.page_size
    shape = warmup_shape(args.max_running_requests, args.chunked_prefill_size,
                         setup.context_length, kv_tokens)
    ids = itertools.count()

    def make(prompt: list[int], params: SamplingParams) -> Request:
        index = next(ids)  # greedy: the seed is never used
        return new_request(f"warmup-{index}", prompt, params, tokenizer, eos, index, lambda _: None)

    seconds = warm_up(engine, make, shape, setup.cfg.vocab_size)
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
    args = with_demo_defaults(args)
    spec_cfg = spec_config_from_args(args)  # bad speculative flags fail before loading
    responder = start_responder(args)
    on_phase = responder.set_phase if responder is not None else _no_hook
    on_phase("joining the process group")
    setup = setup_rank(args, on_phase)
    spec = None
    if spec_cfg is not None:
        on_phase("loading the draft model")
        spec = build_spec(spec_cfg, str(args.speculative_draft_model_path), setup.runner,
                          TPContext(setup.info.rank, setup.info.world_size, setup.comm),
                          setup.dtype, setup.context_length + 64)
    on_phase("warming up / capturing")
    install_static(args, setup.runner, spec, setup.info.world_size, setup.context_length)
    channel = make_channel(None) if setup.info.world_size > 1 else None
    if setup.info.rank != 0:
        return run_follower(lambda: follow(setup.runner, channel, spec), channel, setup.comm)
    from tpserve.server.app_main import serve_http

    scheduler = Scheduler(
        SchedulerConfig(args.page_size, args.max_running_requests, args.chunked_prefill_size,
                        setup.context_length, spec_cfg.lookahead if spec_cfg else 0),
        PageAllocator(setup.runner.kv.cfg.num_pages),
    )
    engine = Engine(setup.runner, scheduler, channel, setup.context_length, spec)
    tokenizer = load_tokenizer(Path(args.tokenizer) if args.tokenizer else setup.model_dir)
    eos = eos_ids(setup.model_dir, setup.cfg)
    if not args.skip_server_warmup:
        with phase("warm-up (largest prefill chunk and decode batch)", on_phase):
            run_warmup(args, setup, engine, tokenizer, eos)
    if args.enable_profiling:
        engine.reconfigure({"profiling": True})
    thread = threading.Thread(target=engine.run, name="tpserve-engine", daemon=True)
    thread.start()
    assert responder is not None  # rank 0 always has one
    code = serve_http(args, setup, engine, tokenizer, eos, thread, responder)
    return finish_leader(engine, thread, code, channel, setup.comm)
