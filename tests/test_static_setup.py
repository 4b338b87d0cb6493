"""Start-up decisions for fixed-shape execution (CPU-testable): buckets from flags, the
capture-safety check, and the graph-memory reserve that shrinks the KV cache."""

from __future__ import annotations

import pytest
import torch

from comm_backends.torch_dist import GlooAllReduce
from tpserve.args import ServerArgs, parse_args
from tpserve.dist import CommSwitch
from tpserve.engine.static_setup import (
    ModelShape,
    batch_sizes,
    capture_unsafe_reason,
    graph_reserve_bytes,
    make_executor,
    max_keys,
)
from tpserve.errors import ConfigError

SHAPE = ModelShape(vocab=128256, hidden=2048, inter_local=8192, heads_local=32,
                   kv_heads_local=8, head_dim=64, itemsize=2)
CUDA = torch.device("cuda")  # only a device descriptor: nothing is allocated


def test_flags_to_buckets() -> None:
    assert batch_sizes(parse_args(["--cuda-graph-max-bs", "16"])) == (1, 2, 4, 8, 12, 16)
    assert batch_sizes(parse_args(["--cuda-graph-bs", "8", "1", "2"])) == (1, 2, 8)
    assert max_keys(1000, 16) == 1072  # context + speculative lookahead, page multiple


def test_capture_safety() -> None:
    comm = CommSwitch({"gloo": GlooAllReduce(None, torch.device("cpu"))}, "gloo")
    assert capture_unsafe_reason(comm, 1) is None
    reason = capture_unsafe_reason(comm, 2)
    assert reason is not None and "'gloo' is not CUDA-graph capture-safe" in reason
    args = ServerArgs(device="cuda")
    with pytest.raises(ConfigError, match="capture-safe"):
        make_executor(args, [], CUDA, comm, 2, 128)


def test_reserve_grows_with_max_bs() -> None:
    small = graph_reserve_bytes(ServerArgs(cuda_graph_max_bs=8), SHAPE, 4096, CUDA)
    large = graph_reserve_bytes(ServerArgs(cuda_graph_max_bs=64), SHAPE, 4096, CUDA)
    spec = graph_reserve_bytes(ServerArgs(cuda_graph_max_bs=64, speculative_algorithm="EAGLE3"),
                               SHAPE, 4096, CUDA)
    assert 0 < small < large < spec
    assert graph_reserve_bytes(ServerArgs(disable_cuda_graph=True), SHAPE, 4096, CUDA) == 0
    assert graph_reserve_bytes(ServerArgs(), SHAPE, 4096, torch.device("cpu")) == 0


def test_graph_buckets_cover_max_running_requests_by_default() -> None:
    assert batch_sizes(parse_args([]))[-1] == ServerArgs().max_running_requests
    assert batch_sizes(parse_args(["--max-running-requests", "50"]))[-1] == 50
    assert batch_sizes(parse_args(["--max-running-requests", "50", "--cuda-graph-max-bs",
                                   "8"]))[-1] == 8


def test_compile_on_cuda_is_refused() -> None:
    from tpserve.engine.static_setup import make_executor

    with pytest.raises(ConfigError, match="--compile is for CPU"):
        make_executor(ServerArgs(compile=True, disable_cuda_graph=True), [],
                      torch.device("cuda", 0), None, 1, 128)


def test_flashinfer_decode_reserve_does_not_grow_with_context() -> None:
    fi = ModelShape(**{**SHAPE.__dict__, "attention": "flashinfer"})
    args = ServerArgs(cuda_graph_max_bs=64)
    short, long = (graph_reserve_bytes(args, fi, ctx, CUDA) for ctx in (4096, 131072))
    # Only the shared page-index buffer grows: 4 bytes per page of the widest bucket.
    assert long - short == 64 * (131072 - 4096) // 16 * 4
    torch_long = graph_reserve_bytes(args, SHAPE, 131072, CUDA)
    assert torch_long > 5 * long  # gathering graphs hold keys up to the gather budget
    spec = ServerArgs(cuda_graph_max_bs=64, speculative_algorithm="EAGLE3")
    assert graph_reserve_bytes(spec, fi, 131072, CUDA) > 10 * long  # verify still gathers


def test_the_gather_budget_bounds_the_reserve_at_long_contexts() -> None:
    """DeepSeek-V3's MLA at TP 8 (576 cached values a key, 16 heads a rank, bucket 64, a 160K
    context): every bucket x span within GRAPH_GATHER_BYTES except the narrowest span, so
    the reserve stays a few GB where gathering the limit at bucket 64 would take ~48 GB."""
    from tpserve.engine.static_setup import GRAPH_GATHER_BYTES, gather_tokens

    mla = ModelShape(vocab=129280, hidden=7168, inter_local=2304, heads_local=16,
                     kv_heads_local=1, head_dim=576, itemsize=2, attention="mla")
    args = ServerArgs(cuda_graph_max_bs=64)
    reserve = graph_reserve_bytes(args, mla, 163840, CUDA)
    assert reserve < 8 * 2**30
    assert gather_tokens(mla) * 4 * 576 * 2 <= GRAPH_GATHER_BYTES
    # the budget, not the context, bounds it: 4x the context changes little
    assert graph_reserve_bytes(args, mla, 4 * 163840, CUDA) < 1.2 * reserve
