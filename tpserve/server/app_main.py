"""Run uvicorn on rank 0 with the FastAPI app wired to the engine."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn
from tokenizers import Tokenizer

from tpserve.args import ServerArgs
from tpserve.engine.engine import Engine
from tpserve.server.engine_client import ClientLimits, EngineClient
from tpserve.server.http import create_app
from tpserve.server.state import ServerState

log = logging.getLogger("tpserve")


def serve_http(args: ServerArgs, setup: Any, engine: Engine, tokenizer: Tokenizer,
               eos: frozenset[int]) -> int:
    limits = ClientLimits(
        vocab_size=setup.cfg.vocab_size, context_length=setup.context_length,
        max_new_tokens_limit=args.max_new_tokens_limit,
        max_queued_requests=args.max_queued_requests, server_seed=args.seed,
    )
    client = EngineClient(engine, tokenizer, eos, limits, {})
    state = ServerState(args=args, client=client, model_path=str(setup.model_dir))
    state.static_info = {
        "tp_size": setup.info.world_size, "device": str(setup.info.device),
        "dtype": str(setup.dtype).replace("torch.", ""), "context_length": setup.context_length,
        "allreduce_backends": list(setup.comm.backends),
        "kv_page_size": args.page_size,
    }
    state.model_info_extra = {"architecture": setup.cfg.architecture,
                              "vocab_size": setup.cfg.vocab_size}
    app = create_app(state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    state.ready = True
    log.info("serving on http://%s:%d", args.host, args.port)
    server.run()
    state.shutting_down = True
    return 0
