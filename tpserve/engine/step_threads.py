"""Torch's intra-op threads per CPU step: one for steps of a few tokens, the rank's share else.

A decode step is ~30 projections (``tpserve::matmul``, on gemm.c's own pool), one attention
call per layer (on the same pool, see ``layers/attention/cpu_native.py``) and a few hundred
tiny ATen ops (norms, rotary, residual adds, the sampler's softmax over the vocabulary). Those
tiny ops gain nothing from a second thread, but an OpenMP region's fork-join barrier waits for
every team thread: with as many busy threads as cores (the HTTP thread streaming tokens,
another rank or process) one region waited milliseconds for a descheduled thread. Measured on
the 2-vCPU Xeon with a build running beside it, batch-1 decode of the 80 MB bench model in
the engine loop, alternating rounds: 60 tok/s with torch at 2 threads, 111 at 1. Larger
steps (prefill, wide batches whose projections are oneDNN gemms) keep every thread. The count
stays set after the step, so sampling and the speculative phases that follow run with the
step's setting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Above this, elementwise work per op (rows x hidden) is large enough to split even where
# every projection is native (every CPU sends any row count to tpserve::matmul).
MAX_SMALL_TOKENS = 64


@dataclass
class StepThreads:
    full: int  # the rank's share (torch.get_num_threads() when the runner was built)
    small_tokens: int  # steps of at most this many tokens run torch's ops on one thread
    current: int = 0

    @classmethod
    def for_device(cls, device: torch.device) -> StepThreads:
        """CPU ranks switch; elsewhere ``small_tokens`` is 0 and ``fit`` never changes a thing."""
        full = torch.get_num_threads()
        small = MAX_SMALL_TOKENS if device.type == "cpu" else 0
        return cls(full, small if full > 1 else 0, full)

    def threads_for(self, tokens: int) -> int:
        return 1 if tokens <= self.small_tokens else self.full

    def fit(self, tokens: int) -> None:
        """Set torch's thread count for a step of ``tokens`` fed tokens (a no-op if unchanged)."""
        want = self.threads_for(tokens)
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
