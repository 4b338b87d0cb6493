"""The one engine builder: server args + this rank -> model, KV cache, comm, speculation.

The HTTP server, the offline engine, the tests' harness and every benchmark assemble an
engine through ``build_engine``, so a setting means the same thing everywhere. Order matters
on a GPU: weights (target and draft) and communicator buffers are allocated before the KV
cache is sized from what memory is left, and CUDA graphs are reserved out of that budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from comm_backends import BackendUnavailable
from comm_backends.base import job_min
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
from tpserve.engine.adapt import make_driver
from tpserve.engine.engine import Engine
from tpserve.engine.follower import Channel, follow
from tpserve.engine.kv_cache import KVCache, KVCacheConfig, KVLayout, PageAllocator, backed_kv
from tpserve.engine.messages import Shutdown
from tpserve.engine.runner import ModelRunner
from tpserve.engine.scheduler import Scheduler, SchedulerConfig
from tpserve.engine.static_setup import (
    ROTARY_HEADROOM,
    ModelShape,
    graph_reserve_bytes,
    install_static,
)
from tpserve.errors import ConfigError
from tpserve.layers import cpu_ops
from tpserve.layers.tp import TPContext
from tpserve.loader import resolve_dtype
from tpserve.model_path import resolve_args
from tpserve.models.config import ModelConfig, ModelConfigError, load_config
from tpserve.models.registry import build_model
from tpserve.preflight import check_before_loading
from tpserve.spec.config import SpecConfig, spec_config_from_args
from tpserve.spec.decoder import SpecDecoder
from tpserve.spec.setup import LoadedDraft, draft_tp_context, load_draft, make_decoder

log = logging.getLogger("tpserve")

StageHook = Callable[[str], None]  # told the name of each start-up stage as it begins


def _no_hook(_: str) -> None:
    return None


@contextmanager
def stage(name: str, on_stage: StageHook = _no_hook) -> Iterator[None]:
    """A start-up stage, logged with its duration so a slow start shows where time went."""
    start = time.perf_counter()
    log.info("%s ...", name)
    on_stage(name)
    yield
    log.info("%s done in %.2fs", name, time.perf_counter() - start)


@dataclass
class BuiltEngine:
    """Everything one rank holds. ``engine`` (the scheduler + loop) exists on rank 0 only."""

    args: ServerArgs
    info: RankInfo
    cfg: ModelConfig
    model_dir: Path
    comm: CommSwitch
    runner: ModelRunner
    spec: SpecDecoder | None
    context_length: int
    dtype: torch.dtype
    channel: Channel | None
    engine: Engine | None

    def follow(self) -> None:
        """Non-zero ranks: mirror rank 0 until it sends ``Shutdown``."""
        assert self.channel is not None, "a single rank has nobody to follow"
        follow(self.runner, self.channel, self.spec)

    def shutdown_followers(self) -> None:
        if self.engine is not None:
            self.engine.flush()
            self.engine.broadcast(Shutdown())


def build_engine(args: ServerArgs, on_stage: StageHook = _no_hook) -> BuiltEngine:
    """Assemble this rank's engine (torchrun's environment says which rank; none: TP=1)."""
    args = resolve_args(with_demo_defaults(args))
    spec_cfg = spec_config_from_args(args)  # bad speculative flags fail before loading
    info = rank_info(args.device)
    threads = cpu_threads_per_rank(info.local_world_size, args.cpu_threads)
    torch.set_num_threads(threads)
    if info.device.type == "cpu":  # CPU projections run on gemm.c's pool: the same share
        cpu_ops.set_matmul_threads(threads)
    with stage("resolving model", on_stage):
        model_dir = Path(args.model) if args.model else demo_target()
        cfg = _load_config(model_dir)
        # Every rank refuses what it cannot serve before the process group forms.
        check_before_loading(cfg, info.world_size, model_dir,
                             generation_config=args.generation_config)
    on_stage("joining the process group")
    init_process_group(info, args.dist_timeout_s)
    dtype = resolve_dtype(args.dtype, cfg.torch_dtype, info.device)
    comm = _make_comm(args, info, dtype)
    context_length = min(args.context_length or cfg.max_position, cfg.max_position)
    tp = TPContext(info.rank, info.world_size, comm, ep_size=args.ep_size)
    max_position = context_length + ROTARY_HEADROOM
    # Any backend runs under CUDA graphs; the model resolves auto for its spec (graphs.py).
    attention = args.attention_backend
    with stage(f"loading weights ({dtype})", on_stage):
        model = build_model(model_dir, tp, dtype, info.device, max_position, cfg, attention)
    draft = None
    if spec_cfg is not None:
        with stage("loading the draft model", on_stage):
            draft_tp = draft_tp_context(args.speculative_draft_tp, tp)
            draft = load_draft(spec_cfg, str(args.speculative_draft_model_path), cfg, draft_tp,
                               dtype, info.device, max_position, ROTARY_HEADROOM,
                               model.embed_tokens)
            draft.model.set_attention_backend(attention)
    with stage("allocating KV cache", on_stage):
        kv = make_kv(args, model, draft, info, dtype, context_length)
    runner = ModelRunner(model, kv, info.device, comm)
    spec = (make_decoder(draft, spec_cfg, runner, tp, args.speculative_draft_ranks)
            if draft is not None and spec_cfg else None)
    on_stage("capturing / compiling")
    install_static(args, runner, spec, info.world_size, context_length)
    channel = make_channel(None) if info.world_size > 1 else None
    engine = None
    if info.rank == 0:
        scheduler = _scheduler(args, kv, context_length, spec_cfg, info.device)
        engine = Engine(runner, scheduler, channel, context_length, spec)
        engine.mixed = not args.disable_mixed_chunk
        if spec is not None:
            scheduler.drafted = spec.drafted
        engine.adaptive = make_driver(args, spec, engine.scheduler.cfg.decode_lookahead,
                                      runner.static)
    return BuiltEngine(args, info, cfg, model_dir, comm, runner, spec, context_length, dtype,
                       channel, engine)


def _make_comm(args: ServerArgs, info: RankInfo, dtype: torch.dtype) -> CommSwitch:
    try:
        comm = create_comm(args.allreduce, info, dtype)
    except (BackendUnavailable, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc), "--allreduce") from None
    if info.device.type == "cuda" and info.world_size > 1:
        # Communicators allocate their buffers at first use: make that happen before the KV
        # cache is sized from the free memory.
        comm.all_reduce(torch.zeros(1, device=info.device))
    return comm


def _load_config(model_dir: Path) -> ModelConfig:
    try:
        return load_config(model_dir)
    except ModelConfigError as exc:
        raise ConfigError(str(exc), "--model") from None


def _scheduler(args: ServerArgs, kv: KVCache, context_length: int,
               spec_cfg: SpecConfig | None, device: torch.device) -> Scheduler:
    cfg = SchedulerConfig(args.page_size, args.max_running_requests, args.chunked_prefill_size,
                          context_length, spec_cfg.reserve if spec_cfg else 0,
                          prefix_cache=not args.disable_radix_cache,
                          mixed_chunk_size=mixed_chunk_size(args, device))
    return Scheduler(cfg, PageAllocator(kv.cfg.num_pages))


# CPU: a step's time grows with its tokens, so a 512-token chunk beside decode tokens stalled
# every stream ~0.5 s on the 2-vCPU bench (0.21x the prompt's TTFT); 128 tokens keep prefill
# matmuls efficient (AMX / gemm tiles are full well below that) and cut the stall ~4x.
CPU_MIXED_CHUNK = 128


def mixed_chunk_size(args: ServerArgs, device: torch.device) -> int:
    if args.mixed_chunk_size is not None:
        return args.mixed_chunk_size
    if device.type == "cpu":
        return min(CPU_MIXED_CHUNK, args.chunked_prefill_size)
    return args.chunked_prefill_size


def kv_budget_bytes(args: ServerArgs, info: RankInfo) -> int:
    if info.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(info.device)
        return max(0, int(total * args.mem_fraction_static) - (total - free))
    return int(args.kv_cache_gb * (1 << 30))


def make_kv(args: ServerArgs, model: torch.nn.Module, draft: LoadedDraft | None, info: RankInfo,
            dtype: torch.dtype, context_length: int) -> KVCache:
    """Pages for the target's layout, sized together with the draft's (same page ids)."""
    layout: KVLayout = model.kv_layout()  # type: ignore[operator]
    # The draft's KV lives on the same pages: budget both per token.
    per_token = layout.bytes_per_token(dtype) + (draft.kv_layout.bytes_per_token(dtype)
                                                 if draft else 0)
    # CUDA graphs are captured after the KV cache exists: leave room for them first.
    reserve = graph_reserve_bytes(args, ModelShape.of(model, dtype), context_length, info.device)
    budget = max(0, kv_budget_bytes(args, info) - reserve)
    pages = max(2, budget // (per_token * args.page_size))
    if args.max_total_tokens:
        pages = min(pages, -(-args.max_total_tokens // args.page_size) + 1)
    pages = job_min(pages)  # every rank sizes the cache alike
    kv_cfg = KVCacheConfig(pages, args.page_size, layout, dtype)
    if kv_cfg.max_tokens < min(context_length, 2 * args.page_size):
        raise ConfigError(f"the KV budget gives only {pages - 1} pages; raise --kv-cache-gb or "
                          "--mem-fraction-static", "--kv-cache-gb")
    start = time.perf_counter()
    kv = backed_kv(kv_cfg, info.device, prefault=not args.disable_kv_prefault)
    log.info("KV cache: %d pages x %d tokens (%.1f MB per rank, %d bytes per token%s)", pages,
             args.page_size, pages * args.page_size * per_token / 1e6, per_token,
             f", backed in {time.perf_counter() - start:.1f} s" if kv.prefault else "")
    return kv
