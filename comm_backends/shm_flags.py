"""The per-rank flags in the header of an ``shm`` segment, and waiting on them.

Owns the header layout, publishing a rank's progress, and the waiting policy: spin briefly,
then yield, then block in a futex on the peer's counter until the peer wakes us (or a short
timeout passes), checking all along that peers are alive and the wait is not over its deadline.

Header: one 128-byte line per rank (two cache lines, so the adjacent-line prefetcher does not
make ranks' flags share a line), as int64 words, each written by its owning rank only:

    word 0  sequence counter: the last phase this rank has *published* (monotonic)
    word 1  status: 0 running, 1 aborted (timed out / saw a dead peer / interrupted), 2 closed
    word 2  when aborted: the rank it gave up on (-1: it was interrupted itself)
    word 3  1 + the CPU this rank ran on when it last published (0: unknown)
    word 4  1 + the rank whose counter this rank sleeps on in a futex (0: not sleeping)

Ordering: plain aligned 8-byte stores and loads. On x86-64 (TSO) a store becomes visible after
every earlier store of the process (the tensor data), and loads are not reordered with loads,
which is the release/acquire pair the protocol needs; ``shm`` refuses other architectures.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable

from comm_backends.shm_segment import ProcId, proc_alive

LINE_BYTES = 128
LINE_WORDS = LINE_BYTES // 8
SEQ_WORD, STATUS_WORD, CULPRIT_WORD, CPU_WORD, SLEEP_WORD = 0, 1, 2, 3, 4
STATUS_RUNNING, STATUS_ABORTED, STATUS_CLOSED = 0, 1, 2

# Busy-poll in bursts of this many reads between clock checks.
_SPIN_BURST = 32
# How long to busy-poll before yielding, unless a peer we wait for last ran on *our* CPU (then
# it cannot run while we spin: the scheduler does stack ranks on one core, e.g. after they sleep
# in a gloo barrier) and we yield at once. With a core per rank, the wait inside a decode step
# is the peer's jitter (tens to hundreds of us); a waiter that gets as far as the futex sleep
# idles its vCPU, and on a VM the hypervisor then deschedules it and takes milliseconds to bring
# it back when other guests are busy. Measured, 2 ranks on the 2-vCPU VM, served TP=2 batch-1
# decode of the 512 x 8 bench model (alternating servers, 12 rounds each): 20 us spin 112 tok/s
# vs 2 ms 124 in a quiet stretch; with neighbours busy (steal) 39 vs 99 (0.5 ms: 94, 10 ms: 93);
# 16 streams unchanged (580 vs 575). Back-to-back 8 KB allreduces: 20 us spin 19-24 us/call,
# 1 ms 18.7; both ranks pinned to one core: 36-43 us/call yielding at once vs 94-110 us with a
# 20 us spin (~1 ms with a 1 ms spin). With more ranks than cores the peer is usually not
# running, so yield almost at once.
SPIN_DEDICATED_S = 2e-3
SPIN_OVERSUBSCRIBED_S = 2e-6
# Then sched_yield for this long, then block in the futex. A yielding waiter still counts as
# busy to the scheduler, so under CPU contention (more ranks than cores, or other jobs) it
# competes with the very ranks it waits for; a blocked one gets the wake-up boost instead.
# Measured under other jobs' load, 4 ranks on 2 cores, 8 MB: ~13-16 ms with the futex stage vs
# 35-60 ms when it was yield for 5 ms then time.sleep(50 us); 100 us vs 1 ms of yielding before
# the futex made no difference beyond noise at any size or world (2, 4, 8), so yield briefly.
_YIELD_S = 100e-6
# A futex sleep is cut short after this long to re-check liveness, status and the deadline;
# it also bounds the cost of a wake-up that might be missed.
_FUTEX_TIMEOUT_NS = 2_000_000
# How often a waiter checks that its peers' processes still exist.
_LIVENESS_PERIOD_S = 0.25
# At most one move off a CPU shared with a peer (FlagBoard._unstack) per this long, so that a
# rank never fights the scheduler in a loop.
_UNSTACK_PERIOD_S = 0.002
_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE: the words are shared between processes


def header_bytes(world: int) -> int:
    # Page-align the data area so every slot starts on its own cache lines and pages.
    return -(-world * LINE_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE


def _cpu_reader() -> Callable[[], int]:
    """glibc's sched_getcpu (vDSO, ~0.25 us), or a stand-in that always says 'unknown'."""
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return lambda: -1
    getcpu.restype = ctypes.c_int
    return getcpu


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """futex(2) wait/wake on words of one shared mapping (ctypes; x86-64 syscall number)."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._anchor = ctypes.c_char.from_buffer(mapping)  # pins the mapping until release()
        self.base = ctypes.addressof(self._anchor)
        self._timeout = _Timespec(0, _FUTEX_TIMEOUT_NS)
        # A locked instruction is a full fence on x86; an uncontended lock round trip is one.
        self._lock = threading.Lock()

    def fence(self) -> None:
        with self._lock:
            pass

    def wait(self, word: int, expected: int) -> None:
        """Sleep while the low 32 bits of int64 ``word`` equal ``expected``'s (or until timeout)."""
        self._syscall(ctypes.c_long(_SYS_FUTEX_X86_64), ctypes.c_void_p(self.base + 8 * word),
                      ctypes.c_long(_FUTEX_WAIT), ctypes.c_long(expected & 0xFFFFFFFF),
                      ctypes.byref(self._timeout), None, ctypes.c_long(0))

    def wake(self, word: int) -> None:
        self._syscall(ctypes.c_long(_SYS_FUTEX_X86_64), ctypes.c_void_p(self.base + 8 * word),
                      ctypes.c_long(_FUTEX_WAKE), ctypes.c_long(0x7FFFFFFF), None, None,
                      ctypes.c_long(0))

    def release(self) -> None:
        del self._anchor


class FlagBoard:
    """This rank's view of the header: publish progress, wait for peers, report failures."""

    def __init__(
        self, mapping: mmap.mmap, rank: int, peers: dict[int, ProcId], timeout_s: float, spin_s: float
    ) -> None:
        world = len(peers)
        self._words = memoryview(mapping)[: world * LINE_BYTES].cast("q")
        self._futex = _Futex(mapping)
        self._rank, self._peers = rank, peers
        self._timeout_s, self._spin_s = timeout_s, spin_s
        line = rank * LINE_WORDS
        self._seq_index, self._cpu_index, self._sleep_index = line + SEQ_WORD, line + CPU_WORD, line + SLEEP_WORD
        self._peer_seq = tuple((r, r * LINE_WORDS + SEQ_WORD) for r in range(world) if r != rank)
        self._peer_sleep = tuple(r * LINE_WORDS + SLEEP_WORD for r in range(world) if r != rank)
        self._getcpu = _cpu_reader()
        self._next_unstack = 0.0
        self.waited_s = 0.0  # time in _wait_slow: a peer had not published when we got there
        self.broken: str | None = None

    @property
    def address(self) -> int:
        """Where the header's words start in this process (for the compiled exchange)."""
        return self._futex.base

    def publish(self, seq: int) -> None:
        words = self._words
        words[self._cpu_index] = self._getcpu() + 1
        words[self._seq_index] = seq
        self._wake_sleepers()

    def _wake_sleepers(self) -> None:
        # Dekker pair with _sleep(): store our counter, fence, then look for sleepers; they store
        # their mark, fence, then re-read our counter. One side always sees the other.
        self._futex.fence()
        mark, words = self._rank + 1, self._words
        for index in self._peer_sleep:
            if words[index] == mark:
                self._futex.wake(self._seq_index)
                return

    def set_status(self, status: int) -> None:
        self._words[self._rank * LINE_WORDS + STATUS_WORD] = status
        self._wake_sleepers()

    def wait_all(self, seq: int) -> None:
        """Return once every peer has published ``seq``; raise if one cannot any more."""
        words = self._words
        for peer, index in self._peer_seq:
            if words[index] < seq:
                self._wait_slow(peer, index, seq)

    def _wait_slow(self, peer: int, index: int, seq: int) -> None:
        start = time.perf_counter()
        try:
            self._wait_for(peer, index, seq)
        finally:
            self.waited_s += time.perf_counter() - start

    def _wait_for(self, peer: int, index: int, seq: int) -> None:
        words = self._words
        stacked = self._stacked(seq) and not self._unstack()
        spin_until = time.perf_counter() + (0.0 if stacked else self._spin_s)
        while True:
            for _ in range(_SPIN_BURST):
                if words[index] >= seq:
                    return
            if time.perf_counter() > spin_until:
                break
        start = time.monotonic()
        next_check = start + _LIVENESS_PERIOD_S
        while words[index] < seq:
            # Check the status only while the counter is short: a peer that published ``seq``
            # and then closed is not an error.
            if words[peer * LINE_WORDS + STATUS_WORD] != STATUS_RUNNING:
                self._peer_stopped(peer)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_PERIOD_S
                self._check_deadline(peer, now - start)
            if now - start < _YIELD_S:
                os.sched_yield()
            else:
                self._sleep(peer, index, seq)

    def _sleep(self, peer: int, index: int, seq: int) -> None:
        words = self._words
        words[self._sleep_index] = peer + 1
        self._futex.fence()
        seen = words[index]
        if seen < seq:
            self._futex.wait(index, seen)
        words[self._sleep_index] = 0

    def _stacked(self, seq: int) -> bool:
        """Whether a peer that still owes ``seq`` last ran on our CPU (so spinning starves it)."""
        words, mine = self._words, self._getcpu() + 1
        for peer, index in self._peer_seq:
            if words[index] < seq and words[peer * LINE_WORDS + CPU_WORD] == mine > 0:
                return True
        return False

    def _unstack(self) -> bool:
        """Move this thread to another of its allowed CPUs; True if it moved.

        Ranks that sleep together (a gloo barrier, a futex wake-up) are often woken onto one
        CPU, and then every exchange is a context switch: 2 ranks, 64 KB, ~60 us a call
        instead of ~20, until the load balancer separates them, which could take a whole
        benchmark size. Excluding the current CPU from the affinity mask migrates the thread
        at once; the mask is restored straight after, so the user's CPU set is kept and the
        thread stays where it landed. Only when there is a CPU per rank (more ranks than CPUs
        must share) and at most once per _UNSTACK_PERIOD_S.

        Measured with the benchmark's pattern (a gloo barrier every 10 calls), 2 ranks on the
        2-core VM, 5 runs of 5 sizes (4K-256K): calls that ended with both ranks on one CPU,
        1255 of 5775 without this vs 428 with it; sizes whose median was 3x too slow, 4 vs 1.
        """
        now = time.monotonic()
        if now < self._next_unstack or not hasattr(os, "sched_setaffinity"):
            return False
        self._next_unstack = now + _UNSTACK_PERIOD_S
        try:
            allowed = os.sched_getaffinity(0)
            others = allowed - {self._getcpu()}
            if len(allowed) < len(self._peers) or not others or others == allowed:
                return False
            os.sched_setaffinity(0, others)
            os.sched_setaffinity(0, allowed)
        except OSError:
            return False
        return True

    def _peer_stopped(self, peer: int) -> None:
        line = peer * LINE_WORDS
        if self._words[line + STATUS_WORD] == STATUS_CLOSED:
            self._fail(f"rank {peer} closed the backend", peer)
        culprit = self._words[line + CULPRIT_WORD]
        if culprit < 0:
            self._fail(f"rank {peer} aborted its allreduce (interrupted)", peer)
        self._fail(f"rank {peer} aborted: it gave up waiting for rank {culprit}", culprit)

    def _check_deadline(self, peer: int, waited_s: float) -> None:
        for rank, proc in self._peers.items():
            if rank != self._rank and not proc_alive(proc):
                self._fail(f"rank {rank} (pid {proc.pid}) died", rank)
        if waited_s > self._timeout_s:
            self._fail(f"timed out after {waited_s:.1f} s waiting for rank {peer}", peer)

    def abort(self, why: str, culprit: int = -1) -> None:
        """Mark this rank failed, so peers waiting on it fail now and can name the culprit."""
        self.broken = f"shm allreduce on rank {self._rank}: {why}"
        self._words[self._rank * LINE_WORDS + CULPRIT_WORD] = culprit  # -1: this rank itself
        self.set_status(STATUS_ABORTED)

    def _fail(self, why: str, culprit: int) -> None:
        self.abort(why, culprit)
        raise RuntimeError(self.broken)

    def release(self) -> None:
        self._words.release()
        self._futex.release()
