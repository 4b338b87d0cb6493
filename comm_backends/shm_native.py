"""The ``shm`` backend's compiled part: ``shm_exchange.c`` (which includes ``shm_reduce.c``),
built at first use and loaded with ctypes.

Three entry points:

- the reduction (``NativeReduce.__call__``): sum rows into one or two outputs in fp32. Why
  compiled: torch's 16-bit add is a generic elementwise kernel, and its sum over a stacked
  rank dim is far slower; the fused loop reads each row once and writes the output once.
  Measured on the 2-core CI-like Xeon (AVX-512), one thread, bf16, us (torch -> compiled):
  2 rows 32K 14.7 -> 5.8, 512K 202 -> 118; 4 rows 32K 132 -> 9.3, 512K 1630 -> 212.
- the exchange (``NativeReduce.exchange``): a whole one-shot or two-shot allreduce, copies and
  flags included, driven by an ``ExchangePlan`` built once per message shape. It saves the
  per-call Python work that dominated small messages (see ``shm_exchange.c``).
- ``exchange_blocking``: the same exchange with its waits done in C, called by address from
  the native decoder stack, which reduces between layer halves without returning to Python
  (``ShmAllReduce.stack_exchange``).

Building and caching: ``native_build`` (host ``cc -O3 -march=native`` at first use). Where
there is no compiler (or ``TPSERVE_SHM_NATIVE=0``) the backend keeps its torch-op path and
says so once in the log; results are correct either way.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from comm_backends.native_build import bind, load_vectorised
from comm_backends.shm_flags import CPU_WORD, LINE_WORDS, SEQ_WORD, SLEEP_WORD, STATUS_WORD

SOURCE = Path(__file__).with_name("shm_exchange.c")
DEPENDS = (Path(__file__).with_name("shm_reduce.c"),)
_SYMBOLS = {torch.float32: "reduce_f32", torch.bfloat16: "reduce_bf16", torch.float16: "reduce_f16"}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ARGTYPES = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_int64)
RowPointers = ctypes.Array  # of c_void_p: one row address per rank, in rank order
Span = tuple[int, int, int]  # (address in the segment, byte offset in the tensor, bytes)


def row_pointers(addresses: list[int]) -> RowPointers:
    return (ctypes.c_void_p * len(addresses))(*addresses)


class _Board(ctypes.Structure):
    _fields_ = [("words", ctypes.c_void_p), ("spin_ns", ctypes.c_int64), ("rank", ctypes.c_int32),
                ("world", ctypes.c_int32), ("line_words", ctypes.c_int32),
                ("seq_word", ctypes.c_int32), ("status_word", ctypes.c_int32),
                ("cpu_word", ctypes.c_int32), ("sleep_word", ctypes.c_int32)]


class _Span(ctypes.Structure):
    _fields_ = [("shm", ctypes.c_void_p), ("offset", ctypes.c_int64), ("nbytes", ctypes.c_int64)]


class _Plan(ctypes.Structure):
    _fields_ = [("board", ctypes.POINTER(_Board)), ("rows", ctypes.POINTER(ctypes.c_void_p)),
                ("publish", ctypes.POINTER(_Span)), ("gather", ctypes.POINTER(_Span)),
                ("out2", ctypes.c_void_p), ("n", ctypes.c_int64), ("offset", ctypes.c_int64),
                ("dtype", ctypes.c_int32), ("rounds", ctypes.c_int32),
                ("n_publish", ctypes.c_int32), ("n_gather", ctypes.c_int32)]


def board(words_address: int, rank: int, world: int, spin_s: float) -> _Board:
    """The C view of a segment's flag header (layout from ``shm_flags``)."""
    return _Board(words_address, int(spin_s * 1e9), rank, world, LINE_WORDS, SEQ_WORD, STATUS_WORD,
                  CPU_WORD, SLEEP_WORD)


@dataclass(frozen=True)
class ExchangePlan:
    """One message shape's exchange; holds every ctypes object the C struct points into."""

    plan: _Plan
    keep: tuple[object, ...]
    address: int
    rounds: int  # sequence numbers one call uses


def _spans(spans: list[Span]) -> ctypes.Array:
    return (_Span * max(1, len(spans)))(*(_Span(*s) for s in spans))


def exchange_plan(flags: _Board, rows: list[int], publish: list[Span], gather: list[Span],
                  out2: int | None, n: int, offset: int, dtype: torch.dtype) -> ExchangePlan:
    """One-shot when ``gather`` is empty and ``out2`` None (rows: every rank's slot half, summed
    into the tensor); two-shot otherwise (rows: my segment in each rank's in-half; C puts the
    tensor's own segment, at byte ``offset``, in place of row ``rank``)."""
    rounds = 1 if out2 is None else 2
    row_array, pub, gat = row_pointers(rows), _spans(publish), _spans(gather)
    plan = _Plan(ctypes.pointer(flags), row_array, pub, gat, out2, n, offset, _DTYPE_CODES[dtype],
                 rounds, len(publish), len(gather))
    return ExchangePlan(plan, (flags, row_array, pub, gat), ctypes.addressof(plan), rounds)


@dataclass(frozen=True)
class NativeReduce:
    """Typed entry points of the compiled library."""

    kernels: dict[torch.dtype, ctypes._CFuncPtr]
    run: ctypes._CFuncPtr
    max_ranks: int
    # Address of ``exchange_blocking`` (an exchange whose waits stay in C), for native callers.
    blocking: int = 0

    def __call__(self, rows: RowPointers, nrows: int, out: int, out2: int | None, n: int,
                 dtype: torch.dtype) -> None:
        """Sum ``n`` elements of each of ``nrows`` rows into address ``out`` (and ``out2``)."""
        self.kernels[dtype](rows, nrows, out, out2, n)

    def exchange(self, plan: ExchangePlan, tensor: int, seq: int, stage: int) -> int:
        """Run ``plan`` on the tensor at address ``tensor`` from ``stage`` (0 first); returns 0
        when done, else the stage to resume at once every peer has published seq + stage - 1."""
        return self.run(plan.address, tensor, seq, stage)


def bind_library(lib: ctypes.CDLL) -> NativeReduce:
    """Typed entry points of a loaded build of ``shm_exchange.c``."""
    run = lib.exchange
    run.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32)
    run.restype = ctypes.c_int32
    max_ranks = lib.exchange_max_ranks
    max_ranks.restype = ctypes.c_int32
    blocking = ctypes.cast(lib.exchange_blocking, ctypes.c_void_p).value or 0
    return NativeReduce(bind(lib, _SYMBOLS, _ARGTYPES, None), run, int(max_ranks()), blocking)


@cache
def load() -> NativeReduce | None:
    """The compiled library, or None (with the reason logged once) where it cannot be used."""
    lib = load_vectorised(SOURCE, "reduce_lanes", "TPSERVE_SHM_NATIVE", "shm reduces with torch ops",
                          DEPENDS)
    return None if lib is None else bind_library(lib)
