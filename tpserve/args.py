"""Server arguments: one frozen dataclass, flag names following SGLang where one exists."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = None  # None: the built-in demo model
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    allreduce: str = "auto"  # comma list; the first is active
    device: str = "auto"
    dtype: str = "auto"
    context_length: int | None = None
    max_running_requests: int = 64
    max_queued_requests: int = 256
    chunked_prefill_size: int = 512
    mixed_chunk_size: int | None = None  # None: 128 on CPU, --chunked-prefill-size on CUDA
    page_size: int = 16
    mem_fraction_static: float = 0.85
    kv_cache_gb: float = 1.0  # CPU KV budget per rank
    disable_kv_prefault: bool = False  # CPU: back the KV cache's memory at start-up by default
    max_total_tokens: int | None = None
    cpu_threads: int | None = None
    max_new_tokens_limit: int = 32768
    seed: int = 0
    log_level: str = "info"
    dist_timeout_s: float = 600.0
    api_key: str | None = None
    enable_profiling: bool = False
    skip_server_warmup: bool = False
    max_request_bytes: int = 8 << 20  # larger HTTP bodies get 413
    shutdown_timeout_s: float = 10.0  # grace for in-flight requests on SIGTERM/SIGINT
    speculative_algorithm: str | None = None  # None | "EAGLE3"
    speculative_draft_model_path: str | None = None
    # A 4-deep chain: the best fixed setting on the demo pair, and where the adaptive chooser
    # starts (README, "Speculative decoding: what the server does by default"). Its KV
    # reserve (lookahead + steps = 9) still admits live switches to trees of up to 8 nodes.
    speculative_num_steps: int = 4
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 5
    speculative_draft_tp: int = 1  # 1: every rank holds the whole draft (no draft collectives)
    speculative_draft_ranks: str = "auto"  # auto | all | one: which ranks run a replicated draft
    speculative_adaptive: str = "on"  # on | off: pick the speculative setting per step
    disable_cuda_graph: bool = False
    disable_radix_cache: bool = False  # prefix caching is on by default
    disable_mixed_chunk: bool = False  # decode tokens and prompt chunks share steps by default
    cuda_graph_max_bs: int | None = None  # None: --max-running-requests (every batch fits)
    cuda_graph_bs: tuple[int, ...] | None = None  # explicit buckets (default: SGLang-like)
    compile: bool = False  # CPU: torch.compile'd decode phases
    compile_mode: str = "default"
    served_model_name: str | None = None  # None: the demo's name, else the model directory's
    chat_template: str | None = None  # FILE, a named template, or inline Jinja
    tool_call_parser: str | None = None  # hermes | llama3_json: tool calls read from chat output
    generation_config: str = "auto"  # auto | ignore | DIR
    attention_backend: str = "auto"  # tpserve.layers.attention.registry.NAMES
    admin_api_key: str | None = None  # default: --api-key
    allow_unauthenticated: bool = False  # serve beyond loopback without a key
    profile_dir: str | None = None  # /admin/profile traces (default: a private per-user dir)
    ep_size: int = 1  # expert parallelism for MoE layers: 1 or the TP size
    extra: dict[str, object] = field(default_factory=dict)


FLAG_HELP = {
    "model": "checkpoint directory, Hugging Face cache entry, or repo id in the local "
             "Hugging Face cache (default: the built-in demo model)",
    "tokenizer": "tokenizer directory or cached repo id (default: the model directory)",
    "host": "bind address", "port": "HTTP port",
    "allreduce": "allreduce backend(s): auto, gloo, shm, nccl, cuda_p2p, symm_mem, hier; "
                 "a comma list initialises several, the first active",
    "device": "auto | cpu | cuda", "dtype": "auto | bfloat16 | float16 | float32",
    "context_length": "max prompt + output tokens (default: the model's)",
    "max_running_requests": "requests decoded together",
    "max_queued_requests": "requests allowed to wait beyond --max-running-requests; "
                           "more get 503 with Retry-After",
    "chunked_prefill_size": "max prompt tokens per prefill step",
    "mixed_chunk_size": "max prompt tokens in a step that also carries running requests' "
                        "decode tokens (default: 128 on CPU, where a step's time grows with "
                        "its tokens and this bounds a stream's stall; --chunked-prefill-size "
                        "on CUDA)",
    "page_size": "tokens per KV page",
    "mem_fraction_static": "GPU: fraction of memory for weights + KV cache",
    "kv_cache_gb": "CPU: KV cache budget per rank in GB",
    "max_total_tokens": "cap on KV cache tokens (overrides the memory-based size)",
    "disable_kv_prefault": "CPU: leave the KV cache's memory to be backed at first write "
                           "(faster start-up; by default it is backed at start-up, so no "
                           "step stalls on page faults as the cache fills)",
    "cpu_threads": "torch and matmul-pool threads per rank on CPU (default: cores / local ranks)",
    "max_new_tokens_limit": "largest max_new_tokens a request may ask for",
    "seed": "server seed for requests without one",
    "log_level": "debug | info | warning", "dist_timeout_s": "collective timeout (s)",
    "enable_profiling": "time every engine phase per step (also togglable via /admin/config)",
    "skip_server_warmup": "do not run the largest prefill chunk and decode batch before ready",
    "api_key": "require 'Authorization: Bearer KEY' (also env TPSERVE_API_KEY)",
    "max_request_bytes": "largest HTTP request body accepted (larger: 413)",
    "shutdown_timeout_s": "on SIGTERM/SIGINT, seconds in-flight requests get to finish",
    "speculative_algorithm": "speculative decoding algorithm: EAGLE3 (default: off)",
    "speculative_draft_model_path": "EAGLE-3 draft checkpoint directory",
    "speculative_num_steps": "draft depth (draft forwards per step)",
    "speculative_eagle_topk": "branching factor per draft step (1 = chain)",
    "speculative_num_draft_tokens": "tree nodes verified per step, root included",
    "speculative_draft_tp": "ranks the draft is split over: 1 (default) replicates the whole "
                            "draft on every rank so drafting needs no collective; the TP size "
                            "shards it like the target",
    "speculative_draft_ranks": "with a replicated draft at TP > 1: one (auto's choice on CPU) "
                               "drafts on the last rank, which hands the tree to the others in "
                               "one collective while rank 0 streams output and compacts KV; all "
                               "(auto's choice on GPU) drafts the same tree on every rank with "
                               "no collective",
    "speculative_adaptive": "on (default): choose per step between plain decoding, chains and "
                            "the launch setting from live cost and acceptance measurements; off: "
                            "pin the --speculative-* settings",
    "disable_cuda_graph": "GPU: run decode, draft and verify eagerly (no CUDA graphs)",
    "disable_radix_cache": "turn off prefix caching (reuse of KV pages of shared prompt prefixes)",
    "disable_mixed_chunk": "alternate prefill and decode steps instead of mixing running "
                           "requests' decode tokens with prompt chunks in one step",
    "cuda_graph_max_bs": "largest batch captured as a CUDA graph (GPU) or compiled (--compile) "
                         "(default: --max-running-requests, so no decode batch runs eagerly)",
    "cuda_graph_bs": "explicit batch-size buckets, e.g. 1 2 4 8 (default: 1,2,4,8,12,16,24,...)",
    "compile": "CPU: torch.compile the decode / draft / verify forwards (bucketed like graphs)",
    "compile_mode": "torch.compile mode: default | max-autotune-no-cudagraphs",
    "served_model_name": "model id shown by /v1/models and in responses "
                         "(default: the model directory's name; tpserve-demo for the demo)",
    "chat_template": "chat template: a Jinja FILE, the name of one of the model's named "
                     "templates, or inline Jinja (default: the model's own)",
    "tool_call_parser": "read tool calls out of chat replies to requests with tools (as "
                        "vLLM's parsers of these names): hermes (Hermes, Qwen 2.5/3), "
                        "llama3_json (Llama 3.1/3.2); default: calls stay plain text",
    "generation_config": "sampling defaults: auto (the model's generation_config.json), "
                         "ignore, or a DIR holding a generation_config.json",
    "attention_backend": "attention over the paged KV cache: auto (cpu on CPU where the native "
                         "kernel builds, flashinfer on CUDA where installed, else torch), torch, "
                         "cpu, flashinfer",
    "admin_api_key": "key for /admin/* (also env TPSERVE_ADMIN_API_KEY; default: --api-key)",
    "allow_unauthenticated": "allow --host beyond loopback with no --api-key (anyone who can "
                             "reach the port can generate; /admin too without an admin key)",
    "profile_dir": "directory for /admin/profile traces, created 0700 (default: "
                   "$XDG_RUNTIME_DIR/tpserve-traces, else ~/.cache/tpserve/traces)",
    "ep_size": "MoE expert parallelism: 1 splits every expert over the TP ranks; the TP size "
               "places whole experts on ranks (expert e on rank e // (experts / size))",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpserve", description="Tensor-parallel LLM server")
    for f in dataclasses.fields(ServerArgs):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        names = [flag, "--model-path"] if f.name == "model" else [flag]
        help_text = FLAG_HELP.get(f.name, "")
        if str(f.type) == "bool":
            parser.add_argument(*names, dest=f.name, action="store_true", help=help_text)
            continue
        if str(f.type).startswith("tuple[int"):
            parser.add_argument(*names, dest=f.name, type=int, nargs="+", default=f.default,
                                help=help_text)
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(*names, dest=f.name, type=kind, default=f.default, help=help_text)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = vars(build_parser().parse_args(argv))
    if ns.get("cuda_graph_bs") is not None:
        ns["cuda_graph_bs"] = tuple(sorted(set(ns["cuda_graph_bs"])))
    return ServerArgs(**ns)
