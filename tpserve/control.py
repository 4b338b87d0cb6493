"""The per-step control channel: rank 0 publishes a pickled plan, the other ranks read it.

Within a node, a single-producer broadcast through a private shared-memory segment (a memfd:
it never has a name in /dev/shm, so a rank dying at any point of start-up leaves nothing
behind). Measured on the 2-core machine, a small plan costs ~20-40 us this way versus
~0.5-1 ms for a gloo ``broadcast_object_list`` (two collectives: size, then payload), which
would rival the allreduces it precedes. Across nodes, ``make_channel`` relays through one
leader per node (``control_nodes``).

Layout: [seq i64][nbytes i64 x slots][ack i64 x world][payload slot x slots]: a ring, message
n in slot n % slots. The writer waits only until every rank has read the message that last
used the slot (so it may run ``slots - 1`` messages ahead of the slowest reader: rank 0 sends
a speculative step's commit and the next plan while the drafting rank is still drafting ahead
of both, instead of stalling on the first one), writes payload and size, then publishes seq
(x86 stores are not reordered, and seq is an aligned 8-byte store). Readers spin briefly,
then back off to short sleeps so an idle server does not burn the cores.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from comm_backends.shm_segment import (
    ProcId,
    SegmentRef,
    create_segment,
    map_segment,
    pause_point,
    proc_alive,
)
from comm_backends.topology import node_key


class PeerGone(RuntimeError):
    """A rank the channel was waiting on has exited."""


@dataclass(frozen=True)
class ChannelConfig:
    capacity: int = 16 << 20  # payload bytes over all slots
    slots: int = 4
    spin_iters: int = 2000
    max_sleep_s: float = 0.001
    timeout_s: float | None = None  # None: wait forever, but still notice a dead peer


class ControlChannel:
    """Broadcast from rank 0 to all ranks of the (gloo) ``group`` over shared memory."""

    def __init__(self, group: dist.ProcessGroup | None, cfg: ChannelConfig = ChannelConfig()) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if cfg.slots < 1:
            raise ValueError("the control channel needs one slot or more")
        self.slot_bytes = cfg.capacity // cfg.slots
        header = 1 + cfg.slots + self.world
        size = 8 * header + cfg.capacity
        fd, box = None, [None]
        if self.rank == 0:
            fd, ref = create_segment(size, "tpserve-ctl")
            box = [ref]
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                                       group=group)
            pause_point("control-attach", dist.get_rank())
            ref: SegmentRef = box[0]
            self._mm = map_segment(ref)
            procs: list[Any] = [None] * self.world
            # Doubles as "everyone is attached": rank 0 may drop its descriptor after it.
            dist.all_gather_object(procs, ProcId.current(), group=group)
        finally:
            if fd is not None:
                os.close(fd)
        self.peers: list[ProcId] = procs
        self.peer_pids = [p.pid for p in procs]
        # The header's int64 words through a memoryview: a word read or written this way is
        # one aligned 8-byte move like numpy's, at ~0.1 us instead of ~1 us a numpy scalar op
        # (several a message, on rank 0's critical path between two steps, on caches the
        # step's weight stream had just emptied).
        self._words = memoryview(self._mm)[: 8 * header].cast("q")
        self._ack_at = 1 + cfg.slots  # word index of rank 0's ack
        self._payload_at = 8 * header
        self._last = 0

    def _slot(self, seq: int) -> tuple[int, int]:
        """Message ``seq`` (1, 2, ...): its slot and where that slot's payload starts."""
        slot = (seq - 1) % self.cfg.slots
        return slot, self._payload_at + slot * self.slot_bytes

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.slot_bytes:
            raise ValueError(f"control message of {len(data)} bytes exceeds a slot's "
                             f"{self.slot_bytes}")
        seq = self._last + 1
        reused = seq - self.cfg.slots  # the message this slot held: read by everyone?
        if reused > 0 and not self._all_read(reused):
            self._wait(lambda: self._all_read(reused), self._first_dead_follower)
        slot, at = self._slot(seq)
        words = self._words
        self._mm[at : at + len(data)] = data
        words[1 + slot] = len(data)
        self._last = seq
        words[0] = seq

    def recv(self) -> Any:
        target, words = self._last + 1, self._words
        if words[0] < target:
            self._wait(lambda: words[0] >= target, self._leader_dead)
        slot, at = self._slot(target)
        obj = pickle.loads(self._mm[at : at + words[1 + slot]])
        self._last = target
        words[self._ack_at + self.rank] = target
        return obj

    def _all_read(self, seq: int) -> bool:
        """Whether every follower has read message ``seq``."""
        words, first = self._words, self._ack_at
        return all(words[first + r] >= seq for r in range(1, self.world))

    def dead_peer(self) -> str | None:
        """Rank 0: the first follower whose process is gone, or None."""
        return self._first_dead_follower()

    def _leader_dead(self) -> str | None:
        return None if proc_alive(self.peers[0]) else "rank 0"

    def _first_dead_follower(self) -> str | None:
        for rank, proc in enumerate(self.peers[1:], start=1):
            if not proc_alive(proc):
                return f"rank {rank}"
        return None

    def _wait(self, ready: Any, dead: Any) -> None:
        spins, sleep, start, next_check = 0, 1e-5, time.monotonic(), time.monotonic() + 0.5
        while not ready():
            spins += 1
            if spins < self.cfg.spin_iters:
                os.sched_yield()
                continue
            time.sleep(sleep)
            sleep = min(sleep * 2, self.cfg.max_sleep_s)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                who = dead()
                if who is not None:
                    raise PeerGone(f"{who} exited; stopping")
                if self.cfg.timeout_s is not None and now - start > self.cfg.timeout_s:
                    raise TimeoutError("control channel timed out")

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            words = getattr(self, "_words", None)
            if words is not None:
                words.release()  # close() refuses while a view of the map is exported
            mm.close()


class Channel(Protocol):
    """What the engine needs from a control channel."""

    peer_pids: list[int]  # rank 0: this node's ranks' pids (the watchdog checks them)

    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def dead_peer(self) -> str | None: ...
    def close(self) -> None: ...


def make_channel(group: dist.ProcessGroup | None) -> Channel:
    """Shared memory when every rank is on this node, else a relay through node leaders.

    Nodes are torchrun's (``GROUP_RANK``), so two torchrun invocations on one machine relay
    exactly as two hosts would.
    """
    keys: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, node_key(), group=group)
    if len(set(keys)) == 1:
        return ControlChannel(group)
    from tpserve.control_nodes import NodeRelayChannel

    return NodeRelayChannel(group, keys)
