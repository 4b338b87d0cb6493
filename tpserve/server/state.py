"""What the HTTP layer knows about the running server: readiness, info, the engine client."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tpserve.args import ServerArgs
from tpserve.server.engine_client import EngineClient


@dataclass
class ServerState:
    args: ServerArgs
    client: EngineClient
    model_path: str
    model_info_extra: dict[str, Any] = field(default_factory=dict)
    static_info: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    shutting_down: bool = False
    failure: str | None = None  # set by the watchdog: a rank or the engine died

    def mark_shutting_down(self) -> None:
        self.shutting_down = True

    def unhealthy_reason(self) -> str | None:
        engine = self.client.engine
        if self.failure is not None:
            return self.failure
        if engine.error is not None:
            return f"engine failed: {engine.error}"
        if self.shutting_down or engine.stopping.is_set():
            return "server is shutting down"
        if not self.ready:
            return "server is starting"
        return None

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.args.tokenizer or self.model_path,
                "is_generation": True, **self.model_info_extra}

    async def server_info(self) -> dict[str, Any]:
        live = await self.client.call(_engine_snapshot)
        args = dataclasses.asdict(self.args)
        args.pop("api_key", None)
        args.pop("admin_api_key", None)
        return {**args, **self.static_info, **live}


def _layer_stack(model: Any) -> str:
    if getattr(model, "stack", None) is not None:
        return "native"
    return getattr(model, "stack_reason", "") or "not a Llama-family model"


def _engine_snapshot(engine: Any) -> dict[str, Any]:
    sched = engine.scheduler
    comm = engine.runner.comm
    stats = engine.stats
    return {
        "allreduce_active": comm.active_name if comm else None,
        # The native layer stack (layers/fused_decoder.py) or why the Python layers run.
        "layer_stack": _layer_stack(engine.runner.model),
        "allreduce_stats": comm.stats() if comm else {},
        "kv_pages_total": sched.allocator.num_usable,
        # Free for a new request: the free list plus cached pages nobody uses (evictable).
        "kv_pages_free": sched.allocator.num_free + (sched.cache.evictable_pages
                                                     if sched.cache is not None else 0),
        "prefix_cache": None if sched.cache is None else {
            "pages": sched.cache.num_pages, "evictable_pages": sched.cache.evictable_pages,
            "hit_tokens": sched.cache.stats.hit_tokens,
            "queried_tokens": sched.cache.stats.queried_tokens,
            "hit_rate": sched.cache.stats.hit_rate},
        "num_running_reqs": len(sched.running),
        "num_waiting_reqs": len(sched.waiting),
        "preemptions": sched.preemptions,
        # Speculation statistics belong to the decoder; reported where clients read them.
        "engine": {**dataclasses.asdict(stats),
                   "extra": {"spec": engine.spec.snapshot(),
                             "spec_adaptive": engine.adaptive_snapshot()}
                   if engine.spec is not None else {}},
        "control_message_us_avg": 1e6 * stats.control_seconds / max(1, stats.steps),
        "active": engine.active_settings(),
        # The adaptive chooser's view sits next to the phase times it is computed from.
        "profile": {**engine.profiler.snapshot(),
                    "speculative_adaptive": engine.adaptive_snapshot()},
        # CUDA graphs / torch.compile: buckets, capture or compile time, memory per set
        "cuda_graph": dict(getattr(engine.runner, "graph_info", {})),
    }
