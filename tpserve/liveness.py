"""Rank 0 learns at once when a rank on another node exits: one TCP connection per rank.

Within a node, ranks watch each other's pids (``/proc``); across nodes a pid means nothing,
and an idle rank 0 takes part in no collective that would fail. So every other rank keeps a
connection to rank 0 for the life of the job: the kernel closes it when that process dies,
however it dies, and rank 0's watcher thread sees the end of the stream at once. A rank that
leaves cleanly says ``bye`` first. The listening socket accepts only the job's ranks (a random
token travels over the process group) and closes once they are all connected.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

log = logging.getLogger("tpserve")
BYE = b"bye"
_HELLO = struct.Struct("!i16s")  # rank, token


def _listen() -> tuple[socket.socket, tuple[str, int]]:
    """A listening socket on the address the job already reaches rank 0's host by (torchrun's
    MASTER_ADDR), and the address to give the other ranks."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        host = socket.gethostbyname(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        sock.bind((host, 0))
    except OSError:  # MASTER_ADDR is not an address of this host: listen everywhere
        host = socket.getfqdn()
        sock.bind(("", 0))
    sock.listen()
    return sock, (host, sock.getsockname()[1])


class PeerWatch:
    """Rank 0's view: which ranks are still connected. ``dead_peer()`` names the first gone."""

    def __init__(self, conns: dict[int, socket.socket], nodes: list[int],
                 on_death: Callable[[str], None]) -> None:
        self._conns, self._nodes, self._on_death = conns, nodes, on_death
        self._dead: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpserve-peer-watch", daemon=True)
        self._thread.start()

    def dead_peer(self) -> str | None:
        return self._dead

    def _run(self) -> None:
        while self._conns and not self._stop.is_set():
            ready, _, _ = select.select(list(self._conns.values()), [], [], 0.5)
            for sock in ready:
                rank = next(r for r, s in self._conns.items() if s is sock)
                try:
                    data = sock.recv(16)
                except OSError:
                    data = b""
                del self._conns[rank]
                sock.close()
                if data != BYE and self._dead is None and not self._stop.is_set():
                    self._dead = f"rank {rank} (node {self._nodes[rank]}) exited"
                    self._on_death(self._dead)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for sock in self._conns.values():
            sock.close()
        self._conns.clear()


class Link:
    """A non-zero rank's end: kept open for the life of the process; ``close`` says bye."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock

    def close(self, bye: bool = True) -> None:
        """``bye=False`` (leaving after a failure) lets rank 0 count this as a death."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                if bye:
                    sock.sendall(BYE)
            except OSError:
                pass
            sock.close()


def connect(group: dist.ProcessGroup | None, nodes: list[int],
            on_death: Callable[[str], None], timeout_s: float = 120.0) -> PeerWatch | Link:
    """Collective over ``group`` (gloo): rank 0 gets a PeerWatch, every other rank a Link."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    listener: socket.socket | None = None
    box: list[Any] = [None]
    if rank == 0:
        listener, address = _listen()
        box = [(address, secrets.token_bytes(16))]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    address, token = box[0]
    if listener is None:
        sock = socket.create_connection(address, timeout=timeout_s)
        sock.sendall(_HELLO.pack(rank, token))
        sock.settimeout(None)
        return Link(sock)
    try:
        return PeerWatch(_accept(listener, token, world, timeout_s), nodes, on_death)
    finally:
        listener.close()


def _accept(listener: socket.socket, token: bytes, world: int, timeout_s: float
            ) -> dict[int, socket.socket]:
    conns: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    while len(conns) < world - 1:
        listener.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            missing = sorted(set(range(1, world)) - set(conns))
            raise TimeoutError(f"ranks {missing} never connected to rank 0") from None
        sock.settimeout(5)
        try:
            peer, theirs = _HELLO.unpack(sock.recv(_HELLO.size, socket.MSG_WAITALL))
        except (OSError, struct.error):
            sock.close()
            continue
        if theirs != token or not 0 < peer < world or peer in conns:
            sock.close()  # not one of ours
            continue
        sock.settimeout(None)
        conns[peer] = sock
    return conns


def exit_after(grace_s: float) -> Callable[[str], None]:
    """The default reaction on rank 0: log now, and exit 1 unless the process ends first.

    The grace lets the server's own watchdog (which polls ``dead_peer``) shut down cleanly.
    """
    def react(reason: str) -> None:
        log.error("%s; the job cannot continue", reason)
        timer = threading.Timer(grace_s, _exit_now, args=(reason,))
        timer.daemon = True
        timer.start()

    return react


def _exit_now(reason: str) -> None:
    log.error("%s; exiting", reason)
    logging.shutdown()
    os._exit(1)
