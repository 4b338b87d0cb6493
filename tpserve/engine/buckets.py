"""Shape buckets for captured (CUDA graph) and compiled (torch.compile) forwards.

A captured or compiled forward only runs at the exact shapes it was built for. Batches are
therefore padded up to the next *batch bucket* B and *key bucket* T with inert rows/keys:

- an inert request row feeds token 0 at position 0, writes its K/V to the dummy slot 0 and
  attends only to slot 0 (so its softmax is finite and no real slot is touched);
- an inert key column reads slot 0 and is masked out for every query.

Real rows therefore see exactly the same keys as in the unpadded batch; only floating-point
blocking inside matmul/attention kernels may differ, never which keys are attended.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpserve.engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class Buckets:
    batch_sizes: tuple[int, ...]  # ascending
    key_sizes: tuple[int, ...]  # ascending; each a multiple of the page size

    def pick(self, batch: int, keys: int) -> tuple[int, int] | None:
        """Smallest (B, T) bucket holding a batch; None when it must run eagerly."""
        b = next((s for s in self.batch_sizes if s >= batch), None)
        t = next((s for s in self.key_sizes if s >= keys), None)
        return None if b is None or t is None else (b, t)


def default_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """SGLang-like: dense at small sizes (where padding waste matters most), then every 8/16/32."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 513, 16), *range(544, 4097, 32)]
    # The largest bucket is max_bs itself: a batch of max_bs must never fall through to eager.
    return tuple(sorted({s for s in sizes if s < max_bs} | {max(1, max_bs)}))


def power_of_two_keys(max_keys: int, page_size: int, smallest: int = 64) -> tuple[int, ...]:
    """Key buckets that double from ``smallest`` (rounded to pages) up to ``max_keys``.

    Doubling bounds the number of compiled shapes to log2(context), and wastes at most half
    the gathered keys (masked keys cost gather + SDPA work, not correctness).
    """
    top = round_up(max_keys, page_size)
    sizes, size = [], round_up(min(smallest, top), page_size)
    while size < top:
        sizes.append(size)
        size = round_up(size * 2, page_size)
    return (*sizes, top)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pad_forward_batch(fb: ForwardBatch, batch: int, keys: int) -> ForwardBatch:
    """Pad ``fb`` [b, Q] / [b, T] to [batch, Q] / [batch, keys] with inert rows and keys."""
    b, t = fb.read_slots.shape
    if (b, t) == (batch, keys):
        return fb
    if batch < b or keys < t:
        raise ValueError(f"bucket ({batch}, {keys}) is smaller than the batch ({b}, {t})")
    queries = fb.num_queries
    read = fb.read_slots.new_zeros(batch, keys)
    read[:b, :t] = fb.read_slots
    mask = fb.mask.new_zeros(batch, 1, queries, keys)
    mask[:b, :, :, :t] = fb.mask
    mask[b:, :, :, 0] = True  # inert rows attend to the dummy slot only
    return ForwardBatch(pad_rows(fb.input_ids, batch), pad_rows(fb.positions, batch),
                        pad_rows(fb.write_slots, batch), read, mask)


def pad_rows(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """Zero-pad dim 0 of ``tensor`` to ``batch`` rows."""
    if tensor.shape[0] == batch:
        return tensor
    out = tensor.new_zeros(batch, *tensor.shape[1:])
    out[: tensor.shape[0]] = tensor
    return out
