"""Run uvicorn on rank 0 with the FastAPI app wired to the engine.

The app is the SGLang API (``http.create_app``) plus the OpenAI endpoints and ``/metrics``,
behind the ASGI guard (API key, body cap, response counts). A watchdog turns a dead
follower or engine into 503s and a non-zero exit instead of a hang.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST
from tokenizers import Tokenizer

from tpserve.args import ServerArgs
from tpserve.chat_template import ChatTemplate
from tpserve.chat_template_files import load_chat_template
from tpserve.demo import served_name
from tpserve.engine.engine import Engine
from tpserve.generation_config import load_generation_config, log_defaults
from tpserve.heap import freeze_startup_heap
from tpserve.layers.quant import resident_weight_bytes
from tpserve.malloc_preload import active_malloc
from tpserve.server.admin_api import ADMIN_BODIES, register_admin
from tpserve.server.engine_client import ClientLimits, EngineClient
from tpserve.server.guard import Guard, GuardConfig, needs_key
from tpserve.server.http import create_app
from tpserve.server.lifecycle import TpServer, Watchdog, seconds_since_start
from tpserve.server.metrics import ServerMetrics
from tpserve.server.openai_api import OPENAI_BODIES, register_openai
from tpserve.server.openapi_util import finish_schema
from tpserve.server.protocol import AbortRequest, ErrorResponse, GenerateRequest
from tpserve.server.security import resolve_keys
from tpserve.server.startup_http import StartupResponder
from tpserve.server.state import ServerState

log = logging.getLogger("tpserve")


def build_app(state: ServerState, metrics: ServerMetrics, template: ChatTemplate,
              model_name: str) -> FastAPI:
    """Every route, the guard and the completed OpenAPI schema; no process-global state."""
    app = create_app(state)
    register_openai(app, state, template, model_name)
    register_admin(app, state)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(await metrics.render(state.client), media_type=CONTENT_TYPE_LATEST)

    keys = resolve_keys(state.args)
    guard = GuardConfig(keys.api, state.args.max_request_bytes, keys.admin)
    metrics.track_routes(frozenset(getattr(route, "path", "") for route in app.routes))
    app.add_middleware(Guard, cfg=guard, on_response=metrics.on_response)
    finish_schema(app, (GenerateRequest, AbortRequest, *OPENAI_BODIES, *ADMIN_BODIES,
                        ErrorResponse), lambda path: needs_key(path, guard))
    return app


def make_state(args: ServerArgs, setup: Any, engine: Engine, tokenizer: Tokenizer,
               eos: frozenset[int]) -> ServerState:
    limits = ClientLimits(
        vocab_size=setup.cfg.vocab_size, context_length=setup.context_length,
        max_new_tokens_limit=args.max_new_tokens_limit,
        max_queued_requests=args.max_queued_requests, server_seed=args.seed,
        max_running_requests=args.max_running_requests,
    )
    client = EngineClient(engine, tokenizer, eos, limits, {})
    state = ServerState(args=args, client=client, model_path=str(setup.model_dir))
    state.static_info = {
        "tp_size": setup.info.world_size, "device": str(setup.info.device),
        "dtype": str(setup.dtype).replace("torch.", ""), "context_length": setup.context_length,
        "allreduce_backends": list(setup.comm.backends),
        "kv_page_size": args.page_size,
        # Per rank: the KV pool (an MLA latent is the same on every rank) and the weights.
        "kv_cache_bytes_per_token": setup.runner.kv.cfg.bytes_per_token,
        "max_total_num_tokens": setup.runner.kv.cfg.max_tokens,
        "resident_weight_bytes": resident_weight_bytes(setup.runner.model),
        "attention_backend": getattr(setup.runner.model.attention, "name", None),
        "rank_pids": list(getattr(engine.channel, "peer_pids", None) or [os.getpid()]),
        # The malloc this rank runs on (tpserve.malloc_preload): a library path, or glibc's.
        "host_malloc": active_malloc(os.environ),
    }
    state.model_info_extra = {"architecture": setup.cfg.architecture,
                              "vocab_size": setup.cfg.vocab_size}
    return state


def serve_http(args: ServerArgs, setup: Any, engine: Engine, tokenizer: Tokenizer,
               eos: frozenset[int], engine_thread: Any = None,
               responder: StartupResponder | None = None) -> int:
    """Serve until stopped; 0 after a graceful stop, 1 after a failure.

    With a ``responder`` (it has answered 503 on the listening socket during start-up), the
    real app takes over that same socket; without one uvicorn binds ``--host``/``--port``.
    """
    state = make_state(args, setup, engine, tokenizer, eos)
    metrics = ServerMetrics()
    state.client.observer = metrics
    template = load_chat_template(*([Path(args.tokenizer)] if args.tokenizer else []),
                                  Path(setup.model_dir), choice=args.chat_template)
    gen = load_generation_config(Path(setup.model_dir), args.generation_config)
    log_defaults(gen, args.generation_config)
    state.client.sampling_defaults = gen.sampling
    model_name = served_name(Path(setup.model_dir), args.served_model_name)
    state.model_info_extra.update({"served_model_name": model_name,
                                   "chat_template": template.origin, **gen.info(),
                                   "eos_token_ids": sorted(eos)})
    app = build_app(state, metrics, template, model_name)
    # Named, not uvicorn's "auto" (which takes whatever is installed). httptools: h11's
    # pure-Python framing of each streamed event cost the loop's thread, which shares the
    # cores with the engine, ~5% of 16-stream decode (bench model, TP = 1, Zen 3). asyncio,
    # not uvloop: with uvloop the engine thread waited for the GIL between its phases
    # (profiled phases covered 0.85 of the step, against 0.96-0.99 on asyncio).
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            loop="asyncio", http="httptools",
                            timeout_graceful_shutdown=max(1, round(args.shutdown_timeout_s)))
    server = TpServer(config, on_stop=state.mark_shutting_down)

    def on_failure(reason: str) -> None:
        state.failure = reason
        server.should_exit = True  # uvicorn polls this flag; safe to set from another thread

    watchdog = None
    if engine_thread is not None:
        watchdog = Watchdog(engine, engine_thread, state.static_info["rank_pids"], on_failure)
        watchdog.start()
    state.static_info["gc_frozen_objects"] = freeze_startup_heap()
    state.ready = True
    sockets = [responder.stop()] if responder is not None else None
    log.info("ready %.1fs after launch: serving on http://%s:%d", seconds_since_start(),
             args.host, args.port)
    server.run(sockets=sockets)
    state.client.encoder.close()
    if watchdog is not None:
        watchdog.done.set()
        # A follower that died during shutdown must still make this rank's exit non-zero.
        state.failure = state.failure or watchdog.problem()
    state.mark_shutting_down()
    return 1 if state.failure or engine.error is not None else 0
