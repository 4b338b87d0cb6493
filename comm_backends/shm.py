"""The ``shm`` backend: allreduce of CPU tensors through one POSIX shared-memory segment.

Owns the algorithm (one-shot / two-shot, chunking, buffer reuse) and the per-call hot path;
setting the segment up across ranks lives in ``shm_rendezvous``, the flags and the waiting in
``shm_flags``, the segment memory in ``shm_segment``.

Data layout after the flag header: every rank owns a slot of two equal halves (A, B).

* one-shot (small messages): copy the input into my half, publish, wait for everyone, then
  reduce all ranks' halves into the output. One flag round trip.
* two-shot (large messages): copy every segment of the input but my own (segment ``rank``)
  into my "in" half, publish, wait; sum segment ``rank`` over my input and every peer's "in"
  half, into my input and my "out" half; publish, wait; copy segment k of rank k's "out" half
  into the input for every peer k (all-gather).

Buffer reuse without a "done reading" flag: the half a round *writes before its first wait* is
never the half peers read in the previous round's last phase (``_last``); by the time a round
writes anything else, its first wait has proved every peer finished the previous round.

Bit-identical results: every rank runs the same reduction on identically shaped views, in rank
order (one-shot), or copies the one owner's sum (two-shot); 16-bit inputs accumulate in fp32
and round once.

Two implementations of each algorithm, the same protocol: where ``shm_native`` builds, one C
call runs a whole exchange (copies, flags, reduction) from a plan made once per shape, and
hands waits that need more than a short spin back to ``FlagBoard``; else the steps are torch
ops driven from Python (kept, and tested, as the fallback).
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, TypeVar

import torch
import torch.distributed as dist

from comm_backends.base import AllReduce, StackExchange
from comm_backends.shm_flags import (
    SPIN_DEDICATED_S,
    SPIN_OVERSUBSCRIBED_S,
    STATUS_CLOSED,
    FlagBoard,
    header_bytes,
)
from comm_backends.shm_native import ExchangePlan, NativeReduce, exchange_plan
from comm_backends.shm_native import board as native_board
from comm_backends.shm_native import load as load_native
from comm_backends.shm_rendezvous import attach, setup_group

ViewsT = TypeVar("ViewsT")
_MiB = 1 << 20
_PAGE = 4096
_MAX_CACHED_VIEWS = 512
# Rows at least this long are reduced with an explicit fp32 loop (see ShmAllReduce._reduce).
# Measured, bf16 rows in shm, us: 4 ranks 32K 106 vs 161 (torch.sum), 256K 824 vs 1109;
# 8 ranks 4K 75 vs 23, 32K 164 vs 149, 256K 1433 vs 2380.
_LOOP_MIN_NUMEL = 32768
# Gathers whose result is smaller than this go as one compiled exchange of a zero-padded sum
# instead of a copy-once round. Measured, 2 ranks, fp32 rows
# of 1024, median us, gather vs padded sum: 8 KB 74 vs 56, 16 KB 104 vs 66, 32 KB 111 vs 160,
# 64 KB 158 vs 273, 128 KB 168 vs 347 (shared 2-core VM under load: the crossover, not the
# absolute numbers, is the point). The gather round is one C call too now (``_gather_plan``);
# the sum still wins at one row of 1024 fp32 (17-23 vs 26 us), the gather from 8 rows.
_GATHER_VIA_SUM_BYTES = 24 << 10


def default_two_shot_bytes(world: int, native: bool = True) -> int:
    """Smallest message that uses two-shot, by world size and implementation (compiled exchange
    or torch ops).

    Measured with ``comm_backends.bench --spawn W --backends shm`` and
    TPSERVE_SHM_TWO_SHOT_BYTES forcing each algorithm, on the 2-core CI-like Xeon VM (AVX-512),
    bf16, median us, one-shot vs two-shot, two runs where given:

        2 ranks   4K: 9-12 vs 11-44   16K: 13-14 vs 12-14   32K: 18-20 vs 15-18
                 64K: 25-28 vs 22-23   128K: 42-45 vs 31-34   1M: 320-330 vs 195-226
                                                                  -> two-shot from 32K
        4 ranks  16K: 111 vs 116   64K: 123 vs 122   128K: 207 vs 172   256K: 341 vs 246
                  1M: 1190 vs 731                                 -> two-shot from 128K
        8 ranks   4K: 203 vs 301   16K: 246 vs 416   64K: 513 vs 553   128K: 855 vs 594
                  1M: 4206 vs 1756                                -> two-shot from 128K

    Two-shot publishes only the segments peers need, sums a rank's own segment straight from
    its input and reads each peer byte once per phase, so it moves less data across cores than
    one-shot; it pays a second flag round trip, which costs ~1 us in the compiled exchange (it
    cost ~10 us of Python before, and the crossover was 256K at 2 ranks). 4 and 8 ranks share
    2 cores here; with a core per rank the crossover may move.

    With torch-op steps (no compiler) the crossovers are 256K (2 ranks), 32K (4) and 16K (8):
    each step is a Python round trip, and torch's 16-bit sum over many rows is slow, so
    one-shot's W-row sums cost more there. 2 ranks, torch ops, one-shot vs two-shot: 64K 52 vs
    65, 256K 148 vs 90, 1M 467 vs 296.

    Re-measure on the target host and set TPSERVE_SHM_TWO_SHOT_BYTES (or
    ShmConfig.two_shot_bytes) if it differs.
    """
    if not native:
        return 256 << 10 if world <= 2 else 32 << 10 if world <= 4 else 16 << 10
    return 32 << 10 if world <= 2 else 128 << 10


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


@dataclass(frozen=True)
class _OneShot:
    mine: torch.Tensor  # my slot's half, shaped like the input
    stack: torch.Tensor  # [W, *shape]: every rank's same half
    plan: ExchangePlan | None  # the compiled exchange over these views


@dataclass(frozen=True)
class _TwoShot:
    lo: int  # my segment of the message: [lo, hi)
    hi: int
    publish: tuple[tuple[torch.Tensor, int, int], ...]  # (my in-half part, start, stop) of x
    peer_rows: torch.Tensor  # [W, hi - lo]: my segment in every rank's in-half
    out_seg: torch.Tensor  # my segment of my out-half: where peers gather my sum from
    gathers: tuple[tuple[torch.Tensor, int, int], ...]  # (peer's out segment, start, stop) of x
    plan: ExchangePlan | None  # the compiled exchange over these views


class ShmAllReduce(AllReduce):
    """Allreduce over a /dev/shm segment shared by the ranks of one host. Not thread-safe."""

    name: ClassVar[str] = "shm"
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    single_node: ClassVar[bool] = True

    @classmethod
    def environment_refusal(cls, device: torch.device) -> str | None:
        reason = super().environment_refusal(device)
        if reason is not None:
            return reason
        if platform.machine().lower() not in ("x86_64", "amd64"):
            # The flags are plain stores/loads; only x86-64's TSO orders them after the data.
            return f"allreduce backend 'shm' relies on x86-64 memory ordering, this is {platform.machine()}"
        if not hasattr(os, "memfd_create"):
            return "allreduce backend 'shm' needs Linux memfd_create"
        return None

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, config: ShmConfig | None = None
    ) -> None:
        super().__init__(group, device)
        self.config = config if config is not None else ShmConfig.from_env()
        self._views: dict[tuple[object, ...], _OneShot | _TwoShot] = {}
        self._bases: dict[torch.dtype, torch.Tensor] = {}
        self._seq = 0
        self._last = 1  # half read in the previous round's last phase
        self._acc: torch.Tensor | None = None  # fp32 scratch for long 16-bit reductions
        self._mapping = None
        self._board: FlagBoard | None = None
        self._native: NativeReduce | None = None
        self._cboard = None  # the C view of the flag header, with the compiled exchange
        # Waits the compiled exchange handed back to FlagBoard, by stage (1: first round,
        # 2: two-shot's second): how often a peer was late or shared our CPU.
        self.handed_back = [0, 0, 0]
        if self.world_size > 1:
            self._setup()

    def _setup(self) -> None:
        self._data_offset = header_bytes(self.world_size)
        native = load_native() if self.config.native else None
        if native is not None and self.world_size > native.max_ranks:
            native = None  # the same on every rank: same library, same world
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
        self._pids = (ctypes.c_int32 * self.world_size)(
            *(attached.peers[r].pid if r in attached.peers else os.getpid()
              for r in range(self.world_size)))
        self._stack_ns = ctypes.c_int64(0)  # nanoseconds of allreduces run by native callers
        # Every rank must reduce the same way (bit-identical results), so all follow rank 0's
        # choice; a rank that cannot follow it fails loudly rather than diverging silently.
        if self.config.native and native is None:
            raise RuntimeError("shm: rank 0 reduces with the compiled kernel but this rank could "
                               "not build it; set TPSERVE_SHM_NATIVE=0 on every rank")
        self._native = native if self.config.native else None
        if self._native is not None:
            self._cboard = native_board(self._board.address, self.rank, self.world_size, spin_s)
        two_shot = self.config.two_shot_bytes
        if two_shot is None:
            two_shot = default_two_shot_bytes(self.world_size, native=self._native is not None)
        self._two_shot_bytes = two_shot

    # ----------------------------------------------------------------- views
    def _base(self, dtype: torch.dtype) -> torch.Tensor:
        base = self._bases.get(dtype)
        if base is None:
            count = 2 * self.world_size * self._half // dtype.itemsize
            base = torch.frombuffer(self._mapping, dtype=dtype, offset=self._data_offset, count=count)
            self._bases[dtype] = base
        return base

    def _cache(self, key: tuple[object, ...], build: Callable[[], ViewsT]) -> ViewsT:
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()  # shapes churn: start over rather than grow without bound
            views = self._views[key] = build()
        return views

    def _one_shot_views(self, dtype: torch.dtype, shape: torch.Size, half: int) -> _OneShot:
        def build() -> _OneShot:
            base, hstride = self._base(dtype), self._half // dtype.itemsize
            inner = torch.empty(shape, device="meta").stride()
            stack = base.as_strided((self.world_size, *shape), (2 * hstride, *inner), half * hstride)
            mine, plan = stack[self.rank], None
            if self._native is not None:
                rows = [stack[k].data_ptr() for k in range(self.world_size)]
                nbytes = mine.numel() * dtype.itemsize
                plan = exchange_plan(self._cboard, rows, [(mine.data_ptr(), 0, nbytes)], [], None,
                                     mine.numel(), 0, dtype)
            return _OneShot(mine, stack, plan)

        return self._cache((dtype, shape, half), build)  # the key _all_reduce probes

    def _two_shot_views(self, dtype: torch.dtype, n: int, half_in: int) -> _TwoShot:
        def build() -> _TwoShot:
            world, rank, base = self.world_size, self.rank, self._base(dtype)
            hstride = self._half // dtype.itemsize
            align = 64 // dtype.itemsize  # whole cache lines per segment: owners never share one
            per_rank = -(-n // world)
            seg = -(-per_rank // align) * align
            lo, hi = min(rank * seg, n), min((rank + 1) * seg, n)

            def half_of(k: int, half: int, start: int, stop: int) -> torch.Tensor:
                return base.as_strided((stop - start,), (1,), (2 * k + half) * hstride + start)

            def gather(k: int) -> tuple[torch.Tensor, int, int]:
                start, stop = min(k * seg, n), min((k + 1) * seg, n)
                return half_of(k, 1 - half_in, start, stop), start, stop

            # Everything but my own segment goes to peers; my segment never leaves my tensor.
            publish = tuple((half_of(rank, half_in, a, b), a, b) for a, b in ((0, lo), (hi, n)) if b > a)
            # Row k: segment ``rank`` of rank k's in-half (row ``rank`` itself is never read).
            peer_rows = base.as_strided((world, hi - lo), (2 * hstride, 1), half_in * hstride + lo)
            gathers = tuple(g for g in (gather(k) for k in range(world) if k != rank) if g[2] > g[1])
            out_seg, plan = half_of(rank, 1 - half_in, lo, hi), None
            if self._native is not None:
                def spans(parts: tuple[tuple[torch.Tensor, int, int], ...]) -> list[tuple[int, int, int]]:
                    size = dtype.itemsize
                    return [(t.data_ptr(), a * size, (b - a) * size) for t, a, b in parts]

                plan = exchange_plan(self._cboard, [peer_rows[k].data_ptr() for k in range(world)],
                                     spans(publish), spans(gathers), out_seg.data_ptr(), hi - lo,
                                     lo * dtype.itemsize, dtype)
            return _TwoShot(lo, hi, publish, peer_rows, out_seg, gathers, plan)

        return self._cache(("two", dtype, n, half_in), build)

    # ----------------------------------------------------------------- algorithm
    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        board = self._board
        if board is None or board.broken:
            raise RuntimeError(board.broken if board else "shm allreduce is closed")
        # Hot path, one dict probe: a contiguous CPU tensor of a shape already seen that takes
        # one round (decode repeats a handful of shapes). Each torch attribute read costs
        # ~0.1 us and ``tensor.device.type`` ~0.5 us; at 2 ranks a 4 KB exchange takes ~4 us.
        views = self._views.get((tensor.dtype, tensor.shape, 1 - self._last))
        if views is None or not (tensor.is_cpu and tensor.is_contiguous()):
            if tensor.dtype not in self.dtypes or not tensor.is_cpu:
                raise TypeError(f"shm allreduce supports CPU {self.dtypes}, got {tensor.device} {tensor.dtype}")
            if not tensor.is_contiguous():
                tensor.copy_(self._all_reduce(tensor.contiguous()))
                return tensor
            nbytes = tensor.nbytes
            if nbytes == 0:
                return tensor
            views = self._single_round_views(tensor, nbytes)
        try:
            if type(views) is _OneShot:
                self._one_shot(tensor, views)
            elif views is not None:
                self._two_shot(tensor, views)
            else:
                self._chunked(tensor.view(-1), two_shot=tensor.nbytes >= self._two_shot_bytes)
        except BaseException as exc:
            # Leaving mid-protocol (Ctrl-C, a bug) would strand the peers until their timeout:
            # tell them now, and refuse further calls here (our sequence is out of step).
            if not board.broken:
                board.abort(f"interrupted by {type(exc).__name__}")
            raise
        return tensor

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows side by side: per chunk of rows that fits a half, one publish and
        wait, then each rank reads its peers' rows once (no summing, no zero padding)."""
        x = tensor.contiguous()
        width = x.shape[-1]
        rows = x.view(-1, width)
        row_bytes = width * x.element_size()
        board = self._board
        if board is None or row_bytes > self._half or x.dtype not in self.dtypes:
            return super()._all_gather(tensor)  # a row larger than a half: gloo's all-gather
        if self._native is not None and x.nbytes * self.world_size < _GATHER_VIA_SUM_BYTES:
            full = x.new_zeros(*x.shape[:-1], width * self.world_size)
            full[..., self.rank * width : (self.rank + 1) * width] = x
            return self._all_reduce(full)  # exact: every other rank adds zeros
        if board.broken:
            raise RuntimeError(board.broken)
        out = x.new_empty(rows.shape[0], self.world_size, width)
        step = self._half // row_bytes
        try:
            for start in range(0, rows.shape[0], step):
                chunk = rows[start : start + step]
                views = self._one_shot_views(x.dtype, chunk.shape, 1 - self._last)
                self._last = 1 - self._last
                views.mine.copy_(chunk)
                if self._native is not None:
                    # One C call publishes, waits and puts every rank's rows in place (was:
                    # FlagBoard's publish and wait from Python, a transposing copy out).
                    into = out[start : start + step]
                    self._exchange(self._gather_plan(views, into), into)
                    continue
                self._step()
                out[start : start + step].copy_(views.stack.transpose(0, 1))
        except BaseException as exc:
            if not board.broken:
                board.abort(f"interrupted by {type(exc).__name__}")
            raise
        return out.view(*x.shape[:-1], self.world_size * width)

    def _gather_plan(self, views: _OneShot, out: torch.Tensor) -> ExchangePlan:
        """The compiled exchange of an all-gather round whose rows are already in my slot of
        ``views``: publish, wait, then rank k's rows from its slot to ``out[:, k]`` (``out``
        [rows, world, width]; offsets only, so the plan serves any ``out`` of that shape).
        2 ranks, 2-vCPU Zen 3, fp32 rows of 1024: 8 rows 58 -> 32-39 us, 64 rows 118 ->
        58-66 us (a speculative verify's logits at batch 1 and 8)."""
        def build() -> ExchangePlan:
            rows, world = out.shape[0], self.world_size
            row_bytes = out.shape[2] * out.element_size()
            gather = [(views.stack[k, r].data_ptr(), (r * world + k) * row_bytes, row_bytes)
                      for r in range(rows) for k in range(world)]
            return exchange_plan(self._cboard, [], [], gather, None, 0, 0, out.dtype)

        # The dtype too: both dtypes of one shape start at the same address of a half, and
        # a float32 plan serving bfloat16 rows copied twice their bytes past ``out``'s end.
        return self._cache(("gather", views.mine.data_ptr(), out.shape, out.dtype), build)

    def _single_round_views(self, tensor: torch.Tensor, nbytes: int) -> _OneShot | _TwoShot | None:
        """Views for a message that fits one chunk, cached under the hot path's key; None if
        it needs chunking."""
        return self._round_views(tensor.dtype, tensor.shape, nbytes, 1 - self._last)

    def _round_views(self, dtype: torch.dtype, shape: torch.Size, nbytes: int,
                     half: int) -> _OneShot | _TwoShot | None:
        if nbytes < self._two_shot_bytes:
            return self._one_shot_views(dtype, shape, half) if nbytes <= self._half else None
        n = nbytes // dtype.itemsize
        if n > self._chunk_elements(dtype, two_shot=True):
            return None
        return self._cache((dtype, shape, half), lambda: self._two_shot_views(dtype, n, half))

    # ----------------------------------------------------------------- native callers
    def stack_exchange(self, dtype: torch.dtype, shape: torch.Size) -> StackExchange | None:
        """The compiled exchange's plans for back-to-back allreduces of ``shape`` (one-shot:
        halves alternate, as ``_one_shot`` flips ``_last``; two-shot: one plan), or None
        where a message of this shape needs Python (no compiled library, chunking)."""
        board, native = self._board, self._native
        if native is None or not native.blocking or board is None or board.broken:
            return None
        if dtype not in self.dtypes:
            return None
        shape = torch.Size(shape)
        nbytes = shape.numel() * dtype.itemsize
        first = self._round_views(dtype, shape, nbytes, 1 - self._last) if nbytes else None
        if first is None or first.plan is None:
            return None
        second = first
        if type(first) is _OneShot:
            second = self._round_views(dtype, shape, nbytes, self._last)
            if second is None or second.plan is None:
                return None
        return StackExchange(native.blocking, (first.plan.address, second.plan.address),
                             self._seq + 1, first.plan.rounds, int(self.config.timeout_s * 1e9),
                             ctypes.addressof(self._pids), ctypes.addressof(self._stack_ns),
                             (first, second, self._pids, self._stack_ns))

    def stack_exchanged(self, ex: StackExchange, calls: int, nbytes: int) -> None:
        self._seq += calls * ex.rounds
        if ex.plans[0] != ex.plans[1] and calls % 2:
            self._last = 1 - self._last
        seconds, self._stack_ns.value = self._stack_ns.value * 1e-9, 0
        # One record: 16 a verify step at TP = 2. Untimed, the profiler's allreduce ms of a
        # TP = 2 decode step were the logits gather's alone.
        self.stats.record(nbytes, seconds, calls=calls)

    def stack_failed(self, why: str) -> None:
        if self._board is not None and not self._board.broken:
            self._board.abort(why)

    def _chunk_elements(self, dtype: torch.dtype, two_shot: bool) -> int:
        step = self._half // dtype.itemsize
        if two_shot:  # chunk a whole number of aligned segments so every segment fits a half
            unit = self.world_size * (64 // dtype.itemsize)
            step = step // unit * unit
        return step

    def _chunked(self, flat: torch.Tensor, two_shot: bool) -> None:
        dtype = flat.dtype
        step = self._chunk_elements(dtype, two_shot)
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

    def _reduce_rows(self, rows: list[torch.Tensor], out: torch.Tensor) -> None:
        """torch-op reduction over ``rows`` (rank order) into ``out``, fp32 inside."""
        if len(rows) == 2:  # bf16/fp16 add computes in fp32 and rounds once
            torch.add(rows[0], rows[1], out=out)
            return
        # An explicit fp32 accumulation, rank 0, 1, 2, ... in order: torch's 16-bit sum over a
        # stacked rank dim measured 1.3-1.7x slower from 32K elements.
        acc = self._accumulator(out.numel()).view(out.shape)
        acc.copy_(rows[0])
        for row in rows[1:]:
            acc.add_(row)
        out.copy_(acc)

    def _accumulator(self, numel: int) -> torch.Tensor:
        if self._acc is None or self._acc.numel() < numel:
            self._acc = torch.empty(max(numel, self._half // 2), dtype=torch.float32)
        return self._acc[:numel]

    def waited_seconds(self) -> float:
        """FlagBoard's slow waits; with the compiled exchange, after its ~20 us spin."""
        return self._board.waited_s if self._board is not None else 0.0

    def _exchange(self, plan: ExchangePlan, x: torch.Tensor) -> None:
        """The compiled exchange; waits it hands back get FlagBoard's full waiting policy."""
        seq, address = self._seq + 1, x.data_ptr()
        self._seq += plan.rounds
        stage = self._native.exchange(plan, address, seq, 0)
        while stage:
            self.handed_back[stage] += 1
            self._board.wait_all(seq + stage - 1)
            stage = self._native.exchange(plan, address, seq, stage)

    def _one_shot(self, x: torch.Tensor, views: _OneShot) -> None:
        self._last = 1 - self._last
        if views.plan is not None:
            self._exchange(views.plan, x)
            return
        views.mine.copy_(x)
        self._step()
        if self.world_size == 2 or x.dtype != torch.float32 and x.numel() >= _LOOP_MIN_NUMEL:
            self._reduce_rows(list(views.stack), x)
        else:
            torch.sum(views.stack, dim=0, out=x)  # one op; accumulates 16-bit inputs in fp32

    def _two_shot(self, x: torch.Tensor, views: _TwoShot) -> None:
        """Reduce-scatter (each rank sums its own segment), then all-gather the sums; ``x``
        is contiguous, any shape.

        Writes "in" = 1 - _last before the first wait, "out" = _last after it; _last stays.
        Only the segments peers need are published, and a rank sums its own segment reading
        its own part straight from ``x``: 1/W less copying each way than staging everything.
        """
        if views.plan is not None:
            self._exchange(views.plan, x)
            return
        x = x.view(-1)
        for dst, a, b in views.publish:
            dst.copy_(x[a:b])
        self._step()
        lo, hi = views.lo, views.hi
        if hi > lo:
            mine = x[lo:hi]
            rows = list(views.peer_rows)
            rows[self.rank] = mine
            self._reduce_rows(rows, mine)
            views.out_seg.copy_(mine)
        self._step()
        for src, a, b in views.gathers:
            x[a:b].copy_(src)

    # ----------------------------------------------------------------- teardown
    def close(self) -> None:
        board, mapping = self._board, self._mapping
        self._board, self._mapping = None, None
        self._views.clear()
        self._bases.clear()
        self._acc = None
        self._cboard = None
        if board is not None:
            board.set_status(STATUS_CLOSED)
            board.release()
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes when that view does
