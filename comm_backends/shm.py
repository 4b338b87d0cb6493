"""The ``shm`` backend: allreduce of CPU tensors through one POSIX shared-memory segment.

Owns the algorithm (one-shot / two-shot, chunking, buffer reuse) and the per-call hot path;
setting the segment up across ranks lives in ``shm_rendezvous``, the flags and the waiting in
``shm_flags``, the segment file in ``shm_segment``.

Data layout after the flag header: every rank owns a slot of two equal halves (A, B).

* one-shot (small messages): copy the input into my half, publish, wait for everyone, then
  reduce all ranks' halves into the output. One flag round trip.
* two-shot (large messages): copy the input into my "in" half, publish, wait; reduce segment
  ``rank`` of every rank's "in" half into segment ``rank`` of my "out" half; publish, wait;
  copy segment k of rank k's "out" half into the output for every k (all-gather).

Buffer reuse without a "done reading" flag: the half a round *writes before its first wait* is
never the half peers read in the previous round's last phase (``_last``); by the time a round
writes anything else, its first wait has proved every peer finished the previous round.

Bit-identical results: every rank runs the same torch op on identically shaped views (one-shot)
or copies the one owner's sum (two-shot); 16-bit inputs accumulate in fp32 (torch's add/sum of
bf16/fp16 compute in fp32 and round once).
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.distributed as dist

from comm_backends.base import AllReduce
from comm_backends.shm_flags import (
    SPIN_DEDICATED_S,
    SPIN_OVERSUBSCRIBED_S,
    STATUS_CLOSED,
    FlagBoard,
    header_bytes,
)
from comm_backends.shm_native import NativeReduce
from comm_backends.shm_native import load as load_native
from comm_backends.shm_rendezvous import attach, setup_group
from comm_backends.shm_segment import SHM_DIR

_MiB = 1 << 20
_PAGE = 4096
_MAX_CACHED_VIEWS = 512
_NEVER = 1 << 62
# Rows at least this long are reduced with an explicit fp32 loop (see ShmAllReduce._reduce).
# Measured, bf16 rows in shm, us: 4 ranks 32K 106 vs 161 (torch.sum), 256K 824 vs 1109;
# 8 ranks 4K 75 vs 23, 32K 164 vs 149, 256K 1433 vs 2380.
_LOOP_MIN_NUMEL = 32768


def default_two_shot_bytes(world: int) -> int:
    """Smallest message that uses two-shot, by world size.

    Measured with ``comm_backends.bench --pin`` on a 2-vCPU Xeon VM (AVX-512) shared with other
    jobs, bf16, one-shot forced vs two-shot forced, best of 2-3 runs of slowest-rank medians, us:

        2 ranks  128K: 68 vs 69   512K: 186 vs 225   1M: 402 vs 390   2M: 781 vs 909
                   4M: 1958 vs 2530   8M: 4302 vs 7649            -> one-shot at every size
        4 ranks    8K: 138 vs 174   16K: 172 vs 196   32K: 243 vs 264 (medians 299 vs 275)
                  64K: 364 vs 210  128K: 783 vs 326               -> two-shot from 32K
        8 ranks    4K: 347 vs 536    8K: 578 vs 545   16K: 692 vs 525   64K: 1767 vs 697
                                                                  -> two-shot from 16K

    With two ranks two-shot moves more bytes (its all-gather) to save half of a cheap add, and
    pays a second flag round trip. 4 and 8 ranks shared 2 cores there, which favours two-shot
    (less total work); with a core per rank the crossover moves up. Re-measure on the target
    host and set TPSERVE_SHM_TWO_SHOT_BYTES (or ShmConfig.two_shot_bytes) if it differs.
    """
    if world <= 2:
        return _NEVER
    return 32 << 10 if world <= 4 else 16 << 10


@dataclass(frozen=True)
class ShmConfig:
    """Tuning knobs; rank 0's values are adopted by every rank at construction."""

    buffer_bytes: int = 4 * _MiB  # per rank; split into two halves, each the largest chunk
    two_shot_bytes: int | None = None  # messages at least this big use two-shot; None = measured
    timeout_s: float = 60.0  # longest wait for a peer before giving up
    spin_s: float | None = None  # busy-poll time before yielding the core; None = by core count
    native: bool = True  # reduce with the compiled kernel (shm_native) where it builds

    @classmethod
    def from_env(cls) -> ShmConfig:
        env = os.environ
        cfg = cls()
        if "TPSERVE_SHM_BUFFER_BYTES" in env:
            cfg = replace(cfg, buffer_bytes=int(env["TPSERVE_SHM_BUFFER_BYTES"]))
        if "TPSERVE_SHM_TWO_SHOT_BYTES" in env:
            cfg = replace(cfg, two_shot_bytes=int(env["TPSERVE_SHM_TWO_SHOT_BYTES"]))
        if "TPSERVE_SHM_TIMEOUT_S" in env:
            cfg = replace(cfg, timeout_s=float(env["TPSERVE_SHM_TIMEOUT_S"]))
        if "TPSERVE_SHM_SPIN_S" in env:
            cfg = replace(cfg, spin_s=float(env["TPSERVE_SHM_SPIN_S"]))
        if "TPSERVE_SHM_NATIVE" in env:
            cfg = replace(cfg, native=env["TPSERVE_SHM_NATIVE"] != "0")
        return cfg

    def half_bytes(self) -> int:
        half = (self.buffer_bytes // 2) // _PAGE * _PAGE
        if half < _PAGE:
            raise ValueError(f"shm buffer_bytes must be at least {2 * _PAGE}, got {self.buffer_bytes}")
        return half


class ShmAllReduce(AllReduce):
    """Allreduce over a /dev/shm segment shared by the ranks of one host. Not thread-safe."""

    name: ClassVar[str] = "shm"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)

    @classmethod
    def unavailable_reason(cls, device: torch.device, world_size: int) -> str | None:
        reason = super().unavailable_reason(device, world_size)
        if reason is not None:
            return reason
        if platform.machine().lower() not in ("x86_64", "amd64"):
            # The flags are plain stores/loads; only x86-64's TSO orders them after the data.
            return f"allreduce backend 'shm' relies on x86-64 memory ordering, this is {platform.machine()}"
        if not os.path.isdir(SHM_DIR):
            return f"allreduce backend 'shm' needs {SHM_DIR}"
        return None

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, config: ShmConfig | None = None
    ) -> None:
        super().__init__(group, device)
        self.config = config if config is not None else ShmConfig.from_env()
        self._views: dict[tuple[object, ...], tuple[torch.Tensor, ...]] = {}
        self._bases: dict[torch.dtype, torch.Tensor] = {}
        self._seq = 0
        self._last = 1  # half read in the previous round's last phase
        self._acc: torch.Tensor | None = None  # fp32 scratch for long 16-bit reductions
        self._mapping = None
        self._board: FlagBoard | None = None
        self._native: NativeReduce | None = None
        if self.world_size > 1:
            self._setup()

    def _setup(self) -> None:
        self._data_offset = header_bytes(self.world_size)
        native = load_native() if self.config.native else None
        config = replace(self.config, native=native is not None)
        attached = attach(setup_group(self.group), self.rank, self.world_size, config,
                          lambda cfg: self._data_offset + 2 * self.world_size * cfg.half_bytes())
        self.config = attached.config
        self._half = self.config.half_bytes()
        self._mapping = attached.mapping
        spin_s = self.config.spin_s
        if spin_s is None:
            dedicated = self.world_size <= len(os.sched_getaffinity(0))
            spin_s = SPIN_DEDICATED_S if dedicated else SPIN_OVERSUBSCRIBED_S
        self._board = FlagBoard(self._mapping, self.rank, attached.peers, self.config.timeout_s, spin_s)
        # Every rank must reduce the same way (bit-identical results), so all follow rank 0's
        # choice; a rank that cannot follow it fails loudly rather than diverging silently.
        if self.config.native and native is None:
            raise RuntimeError("shm: rank 0 reduces with the compiled kernel but this rank could "
                               "not build it; set TPSERVE_SHM_NATIVE=0 on every rank")
        self._native = native if self.config.native else None
        two_shot = self.config.two_shot_bytes
        self._two_shot_bytes = default_two_shot_bytes(self.world_size) if two_shot is None else two_shot

    # ----------------------------------------------------------------- views
    def _base(self, dtype: torch.dtype) -> torch.Tensor:
        base = self._bases.get(dtype)
        if base is None:
            count = 2 * self.world_size * self._half // dtype.itemsize
            base = torch.frombuffer(self._mapping, dtype=dtype, offset=self._data_offset, count=count)
            self._bases[dtype] = base
        return base

    def _cache(
        self, key: tuple[object, ...], build: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, ...]:
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()  # shapes churn: start over rather than grow without bound
            views = self._views[key] = build()
        return views

    def _one_shot_views(self, dtype: torch.dtype, shape: torch.Size, half: int) -> tuple[torch.Tensor, ...]:
        """(my half shaped like the input, then the reduce operands: 2 rows or a [W, ...] stack)."""

        def build() -> tuple[torch.Tensor, ...]:
            base, hstride = self._base(dtype), self._half // dtype.itemsize
            inner = torch.empty(shape, device="meta").stride()
            stack = base.as_strided((self.world_size, *shape), (2 * hstride, *inner), half * hstride)
            mine = stack[self.rank]
            return (mine, stack[0], stack[1]) if self.world_size == 2 else (mine, stack)

        return self._cache(("one", dtype, shape, half), build)

    def _two_shot_views(self, dtype: torch.dtype, n: int, half_in: int) -> tuple[torch.Tensor, ...]:
        """(my in-half[:n], reduce operands of my segment, my out segment, gather rows, tail)."""

        def build() -> tuple[torch.Tensor, ...]:
            world, base, hstride = self.world_size, self._base(dtype), self._half // dtype.itemsize
            align = 64 // dtype.itemsize  # whole cache lines per segment: owners never share one
            per_rank = -(-n // world)
            seg = -(-per_rank // align) * align
            half_out, lo = 1 - half_in, self.rank * seg
            mine = base.as_strided((n,), (1,), (2 * self.rank + half_in) * hstride)
            stack = base.as_strided((world, seg), (2 * hstride, 1), half_in * hstride + lo)
            out_seg = base.as_strided((seg,), (1,), (2 * self.rank + half_out) * hstride + lo)
            # "Diagonal": row k is segment k of rank k's out half.
            diag = base.as_strided((world, seg), (2 * hstride + seg, 1), half_out * hstride)
            full, rem = divmod(n, seg)
            tail = diag[full, :rem] if rem else diag[0, :0]
            operands = (stack[0], stack[1]) if world == 2 else (stack,)
            return (mine, *operands, out_seg, diag[:full], tail)

        return self._cache(("two", dtype, n, half_in), build)

    # ----------------------------------------------------------------- algorithm
    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        board = self._board
        if board is None or board.broken:
            raise RuntimeError(board.broken if board else "shm allreduce is closed")
        if tensor.dtype not in self.dtypes or tensor.device.type != "cpu":
            raise TypeError(f"shm allreduce supports CPU {self.dtypes}, got {tensor.device} {tensor.dtype}")
        if not tensor.is_contiguous():
            tensor.copy_(self._all_reduce(tensor.contiguous()))
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return tensor
        try:
            if nbytes < self._two_shot_bytes and nbytes <= self._half:
                self._one_shot(tensor, self._one_shot_views(tensor.dtype, tensor.shape, 1 - self._last))
            else:
                self._chunked(tensor.view(-1), two_shot=nbytes >= self._two_shot_bytes)
        except BaseException as exc:
            # Leaving mid-protocol (Ctrl-C, a bug) would strand the peers until their timeout:
            # tell them now, and refuse further calls here (our sequence is out of step).
            if not board.broken:
                board.abort(f"interrupted by {type(exc).__name__}")
            raise
        return tensor

    def _chunked(self, flat: torch.Tensor, two_shot: bool) -> None:
        dtype, world = flat.dtype, self.world_size
        step = self._half // dtype.itemsize
        if two_shot:  # chunk a whole number of aligned segments so every segment fits a half
            unit = world * (64 // dtype.itemsize)
            step = step // unit * unit
        for start in range(0, flat.numel(), step):
            x = flat[start : start + step]
            n = x.numel()
            if two_shot:
                self._two_shot(x, self._two_shot_views(dtype, n, 1 - self._last))
            else:
                self._one_shot(x, self._one_shot_views(dtype, x.shape, 1 - self._last))

    def _step(self) -> None:
        self._seq += 1
        self._board.publish(self._seq)
        self._board.wait_all(self._seq)

    def _reduce(self, operands: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        """Sum over ranks into ``out``; same ops on same shapes on every rank, fp32 inside."""
        native = self._native
        if native is not None:
            first = operands[0]
            if len(operands) == 2:
                native(first.data_ptr(), operands[1].data_ptr() - first.data_ptr(), 2, out)
            else:
                native(first.data_ptr(), first.stride(0) * first.element_size(), first.shape[0], out)
            return
        if len(operands) == 2:  # bf16/fp16 add computes in fp32 and rounds once
            torch.add(operands[0], operands[1], out=out)
        elif out.dtype == torch.float32 or out.numel() < _LOOP_MIN_NUMEL:
            torch.sum(operands[0], dim=0, out=out)  # accumulates 16-bit inputs in fp32
        else:
            # torch's 16-bit sum over the rank dim is slow for long rows; an explicit fp32
            # accumulation (rank 0, 1, 2, ... in order) measured 1.3-1.7x faster from 32K.
            stack = operands[0]
            acc = self._accumulator(out.numel()).view(out.shape)
            acc.copy_(stack[0])
            for rank in range(1, stack.shape[0]):
                acc.add_(stack[rank])
            out.copy_(acc)

    def _accumulator(self, numel: int) -> torch.Tensor:
        if self._acc is None or self._acc.numel() < numel:
            self._acc = torch.empty(max(numel, self._half // 2), dtype=torch.float32)
        return self._acc[:numel]

    def _one_shot(self, x: torch.Tensor, views: tuple[torch.Tensor, ...]) -> None:
        self._last = 1 - self._last
        views[0].copy_(x)
        self._step()
        self._reduce(views[1:], x)

    def _two_shot(self, x: torch.Tensor, views: tuple[torch.Tensor, ...]) -> None:
        # Writes "in" = 1 - _last before the first wait, "out" = _last after it; _last stays.
        mine, operands, out_seg, rows, tail = views[0], views[1:-3], views[-3], views[-2], views[-1]
        mine.copy_(x)
        self._step()
        self._reduce(operands, out_seg)
        self._step()
        seg = out_seg.numel()
        full = rows.shape[0]
        if full:
            x[: full * seg].view(full, seg).copy_(rows)
        if tail.numel():
            x[full * seg :].copy_(tail)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        board, mapping = self._board, self._mapping
        self._board, self._mapping = None, None
        self._views.clear()
        self._bases.clear()
        self._acc = None
        if board is not None:
            board.set_status(STATUS_CLOSED)
            board.release()
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when that view does
