"""The tensors one model forward consumes: a ragged batch of query rows over the paged cache.

Request b feeds rows ``q_indptr[b]:q_indptr[b + 1]`` of ``input_ids`` / ``positions``
(decode tokens and prompt chunks mix without padding); how each row attends is described by
``attn`` (``tpserve.layers.attention.AttentionMetadata``: page table, key counts, write
slots, an optional speculative mask), built once per step and read by every layer.

``queries`` is Q when every request feeds exactly Q rows (decode, draft, verify steps): only
such batches are bucketed for CUDA graphs / torch.compile, padded with inert requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tpserve.layers.attention.metadata import AttentionMetadata


@dataclass
class HostWork:
    """Host work a forward runs once, as it enters its long native call and before its first
    collective: rank 0's output events of the previous step (``Engine._forward_step``); on a
    follower, waiting for rank 0 to confirm a step it prepared on a guess (``plain_guess``,
    ``follower.Confirm``: a collective before it would pair with whatever rank 0 runs).

    Why: each streamed token costs the HTTP thread 0.6-0.9 ms of Python on the 2-vCPU Zen 3
    (the SSE event, the middleware, the socket write: its /proc CPU time over 1024 tokens),
    and it holds the GIL meanwhile. Sent between steps, that
    work ran while the engine thread wanted the GIL for its own host work (sampling,
    scheduling, the next layout), so the two queued behind each other; sent just before the
    fused layer stack (which holds no GIL for milliseconds), it runs beside the weight
    stream. Models without such a call run it at the start of their forward, the runner at
    the end at the latest."""

    fn: Callable[[], None] | None = None

    def run(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    attn: AttentionMetadata
    queries: int  # rows per request when uniform, else 0
    host_work: HostWork = field(default_factory=HostWork)

    @property
    def batch_size(self) -> int:
        return self.attn.batch_size

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])
