"""CPU weights in transparent huge pages.

A decode step streams every weight once. With 4 KB pages that is a TLB miss and a page walk
every 4 KB (~20 000 a step for the 79 MB bench model), and where transparent huge pages are in
``madvise`` mode (the default of many distributions, and of the machines we measure on) no
memory gets 2 MB pages unless it asks. Measured on a 2-vCPU AMD EPYC (Zen 3), 2 threads, the
bench model's 33 projections + lm_head through gemm.c, median of 40 passes, five alternating
runs: 5.25-5.62 ms on 4 KB pages, 4.34-4.62 ms on memory advised ``MADV_HUGEPAGE`` (1.18x).

So on CPU every large parameter is moved, right after the model is built and before any weight
is loaded, into one anonymous private mapping advised ``MADV_HUGEPAGE`` (page faults then take
2 MB pages where the kernel has them; where it has none, or THP is off, nothing changes but
the address). Parameters keep their identity (``param.data`` is swapped), so loaders and
everything built later see the new storage.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20
SMALL_PAGE = 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels answer EINVAL
ALIGN = 64  # each parameter starts on a cache line
MIN_BYTES = 1 << 16  # smaller parameters (norms, biases) are not worth a TLB entry


class NotEnoughMemory(MemoryError):
    """The OS will not map or back the memory asked for (it has too little to give)."""


def huge_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed uint8 memory starting on a 2 MB boundary, advised as huge pages.

    Private and anonymous: a shared mapping would be shmem, whose huge pages follow another
    switch (``shmem_enabled``, usually ``never``). The tensor keeps the mapping alive."""
    size = nbytes + HUGE_PAGE  # room to start on a 2 MB boundary
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise NotEnoughMemory(f"could not map {nbytes >> 20} MB: {exc.strerror}") from exc
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        mm.madvise(advice)
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + nbytes]


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    """A zero tensor in huge-page memory (the CPU KV cache: attention streams it like the
    weights). The mapping's pages are zero until first written; ``populate`` backs them all
    now (see ``prefault``) instead of at first touch."""
    t = huge_arena(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
    if populate:
        prefault(t)
    return t


def _madvise_populate(t: torch.Tensor) -> int:
    """``madvise(MADV_POPULATE_WRITE)`` over ``t``'s pages: 0, or the errno."""
    if not sys.platform.startswith("linux"):
        return errno.ENOSYS
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = t.data_ptr() - t.data_ptr() % SMALL_PAGE
    length = t.data_ptr() + t.nbytes - start
    return 0 if libc.madvise(start, length, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max",  # cgroup v2 ("max": none)
                 "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # v1 (~2**63: none)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def available_bytes() -> int | None:
    """What this process can still be given: the kernel's MemAvailable, capped by the memory
    cgroup's limit where one is set (None where neither is known). A best effort: it catches
    a cache larger than the machine or the container, not one that other processes about to
    start will squeeze out."""
    known: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    known.append(int(line.split()[1]) << 10)
    except (OSError, ValueError, IndexError):
        pass
    for path in CGROUP_LIMITS:
        limit = _read_int(path)
        if limit is not None and limit < 1 << 60:
            known.append(limit)
    return min(known) if known else None


def check_available(nbytes: int) -> None:
    """Raise NotEnoughMemory when ``nbytes`` more cannot be backed: backing them anyway would
    wake the OOM killer (no message, just a killed process)."""
    free = available_bytes()
    if free is not None and nbytes > free:
        raise NotEnoughMemory(f"could not back {nbytes >> 20} MB: {free >> 20} MB available")


def prefault(t: torch.Tensor) -> None:
    """Back every page of ``t`` now (writing nothing), so no step pays a first-touch fault.

    Why: a CPU KV cache in huge pages grows into memory never touched before, and each first
    touch of a 2 MB page costs zeroing it; in a VM whose host backs guest memory lazily far
    more. Measured on the 2-vCPU Firecracker VM we benchmark on: ~30 ms per cold 2 MB page
    (70-85 MB/s, the host's cost; a second thread does not help), so the 16 layer-regions of
    the bench model crossing a 2 MB boundary together stalled one step by ~0.4 s every 4096
    cached tokens. llama.cpp pays the same once, clearing its KV buffer when a context is
    created. Raises NotEnoughMemory when ``t`` is larger than the memory available
    (``check_available``) or the kernel refuses: a cache that does not fit fails at start-up,
    not in the middle of serving."""
    if t.nbytes == 0:
        return
    check_available(t.nbytes)
    err = _madvise_populate(t)
    if err in (errno.ENOMEM, errno.EFAULT):
        raise NotEnoughMemory(f"could not back {t.nbytes >> 20} MB: {os.strerror(err)}")
    if err:  # an older kernel or another OS: one write per small page does the same
        t.view(-1).view(torch.uint8)[::SMALL_PAGE].zero_()


def _placed(module: nn.Module, min_bytes: int) -> list[nn.Parameter]:
    """Parameters to move: on the CPU, contiguous, at least ``min_bytes`` (``parameters()``
    yields a shared one once)."""
    return [p for p in module.parameters()
            if p.device.type == "cpu" and p.is_contiguous() and p.nbytes >= min_bytes]


def rehome_parameters(module: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Move ``module``'s large CPU parameters into one huge-page arena (values kept);
    returns the bytes moved."""
    params = _placed(module, min_bytes)
    if not params:
        return 0
    sizes = [-(-p.nbytes // ALIGN) * ALIGN for p in params]
    arena = huge_arena(sum(sizes))
    at = 0
    with torch.no_grad():
        for p, size in zip(params, sizes, strict=True):
            home = arena[at : at + p.nbytes].view(p.dtype).view(p.shape)
            home.copy_(p.data)
            p.data = home
            at += size
    return at
