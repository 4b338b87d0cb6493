"""The control channel across nodes: rank 0 -> node leaders over gloo -> each node over shm.

Every node's lowest rank is its leader. Rank 0 (the first node's leader) broadcasts each plan
to the leaders over a gloo group, then publishes it in its own node's shared-memory channel;
every other leader receives it from that broadcast and republishes it in its node's channel;
the remaining ranks read their node's channel as on one host. So a plan crosses the network
once per node, not once per rank, and within a node costs what it costs on one host.

Failures: a leader whose broadcast fails (rank 0 gone) raises ``PeerGone`` and exits, and its
node's ranks notice their leader's death by pid; rank 0 notices any other rank's death through
``liveness`` (one TCP connection per rank), which ``dead_peer`` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from comm_backends.base import one_line
from comm_backends.topology import node_layout
from tpserve.control import ControlChannel, PeerGone
from tpserve.liveness import Link, PeerWatch, connect, exit_after

# Rank 0, after another node's rank died: how long the server's own watchdog gets to shut
# down cleanly before the process exits by itself.
DEATH_GRACE_S = 10.0


class NodeRelayChannel:
    """Control channel over several nodes; same interface as ``ControlChannel``."""

    def __init__(self, group: dist.ProcessGroup | None, keys: list[Any],
                 on_death: Callable[[str], None] | None = None) -> None:
        self.rank = dist.get_rank(group)
        members = node_layout(keys)

        def global_ranks(ranks: list[int]) -> list[int]:
            return [dist.get_global_rank(group, r) if group else r for r in ranks]

        # new_group is collective over the whole job: every rank creates every group, in order.
        node_groups = [dist.new_group(global_ranks(m), backend="gloo") for m in members]
        self._leaders = dist.new_group(global_ranks([m[0] for m in members]), backend="gloo")
        mine = next(i for i, m in enumerate(members) if self.rank in m)
        self._is_leader = members[mine][0] == self.rank
        self._local = ControlChannel(node_groups[mine]) if len(members[mine]) > 1 else None
        self.peer_pids = self._local.peer_pids if self._local is not None else []
        node_of = [next(i for i, m in enumerate(members) if r in m) for r in range(len(keys))]
        self._src = global_ranks([0])[0]
        self._healthy = True
        self._watch: PeerWatch | Link = connect(group, node_of,
                                                on_death or exit_after(DEATH_GRACE_S))

    def send(self, obj: Any) -> None:
        """Rank 0 only. After any rank died nothing more is relayed: not even a shutdown plan
        may make the other nodes' ranks exit as if the job had ended cleanly."""
        dead = self._watch.dead_peer() if isinstance(self._watch, PeerWatch) else None
        if dead is not None:
            raise PeerGone(f"{dead}; not relaying further plans")
        dist.broadcast_object_list([obj], src=self._src, group=self._leaders)
        if self._local is not None:
            self._local.send(obj)

    def recv(self) -> Any:
        try:
            return self._relay() if self._is_leader else self._local.recv()
        except BaseException:
            self._healthy = False  # leaving because of a failure: rank 0 must hear no "bye"
            raise

    def _relay(self) -> Any:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=self._src, group=self._leaders)
        except RuntimeError as exc:  # gloo: the connection to rank 0's node is gone
            raise PeerGone(f"rank 0's node is unreachable ({one_line(exc)[:200]}); stopping") from exc
        if self._local is not None:
            self._local.send(box[0])
        return box[0]

    def dead_peer(self) -> str | None:
        """Rank 0: a rank of its own node (by pid) or of another node (by its connection)."""
        local = self._local.dead_peer() if self._local is not None else None
        remote = self._watch.dead_peer() if isinstance(self._watch, PeerWatch) else None
        return local or remote

    def close(self) -> None:
        if isinstance(self._watch, Link):
            self._watch.close(bye=self._healthy)
        else:
            self._watch.close()
        if self._local is not None:
            self._local.close()
