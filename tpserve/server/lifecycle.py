"""Process lifecycle: graceful shutdown on signals, failure detection, and a clean exit.

Shutdown (SIGTERM/SIGINT to rank 0, or to the whole torchrun group): rank 0 stops admitting
(503), gives in-flight requests ``--shutdown-timeout-s`` to finish (uvicorn's graceful
shutdown; what is left is cancelled, which aborts it in the engine), then the engine loop
ends and broadcasts the shutdown plan so every follower leaves its loop; each rank closes
its shared memory and exits 0. Followers ignore the signals themselves: they exit when rank 0
says so, or when rank 0 is gone (PeerGone, non-zero).

Failure: rank 0 cannot rely on the engine thread to notice a dead follower (it may be idle,
or blocked in a collective with it), so a watchdog thread checks the followers' pids and the
engine every second; on failure ``/health`` turns 503 and uvicorn is told to exit, and the
process exits 1, after which torchrun tears down the remaining ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import uvicorn

from comm_backends.shm_segment import ProcId, proc_alive, proc_start_time
from tpserve.control import PeerGone

log = logging.getLogger("tpserve")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TpServer(uvicorn.Server):
    """uvicorn that reports the stop signal at once and does not re-raise it on exit.

    Plain uvicorn re-raises a captured SIGTERM after shutting down, which would kill the
    process with -15 and make torchrun treat a graceful stop as a crash.
    """

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_stop = on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        log.info("signal %s: stopping (no new requests; in-flight ones get %.0fs)",
                 signal.Signals(sig).name, self.config.timeout_graceful_shutdown or 0)
        self._on_stop()
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def ignore_stop_signals() -> None:
    """Followers: rank 0 drives shutdown through the control channel, so wait for it."""
    def note(sig: int, _: FrameType | None) -> None:
        log.info("signal %s: waiting for rank 0's shutdown plan", signal.Signals(sig).name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, note)


class Watchdog(threading.Thread):
    """Rank 0: calls ``on_failure(reason)`` once when a follower or the engine dies."""

    def __init__(self, engine: Any, engine_thread: threading.Thread, peer_pids: list[int],
                 on_failure: Callable[[str], None], interval_s: float = 1.0) -> None:
        super().__init__(name="tpserve-watchdog", daemon=True)
        self.engine, self.engine_thread = engine, engine_thread
        # Start times are read now, so a pid the kernel reuses later is not mistaken for ours.
        self.peers = [ProcId(pid, proc_start_time(pid)) for pid in peer_pids]
        self.on_failure, self.interval_s = on_failure, interval_s
        self.done = threading.Event()

    def problem(self) -> str | None:
        for rank, proc in enumerate(self.peers[1:], start=1):
            if not proc_alive(proc):
                return f"rank {rank} (pid {proc.pid}) exited"
        channel = getattr(self.engine, "channel", None)
        gone = channel.dead_peer() if hasattr(channel, "dead_peer") else None
        if gone is not None:  # a rank on another node: its pid means nothing here
            return gone
        if self.engine.error is not None:
            return f"engine failed: {self.engine.error}"
        if not self.engine_thread.is_alive() and not self.engine.stopping.is_set():
            return "engine thread exited"
        return None

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            reason = self.problem()
            if reason is not None:
                log.error("%s; shutting down", reason)
                self.on_failure(reason)
                return


def stop_engine(engine: Any, thread: threading.Thread, failed: bool, timeout_s: float = 30) -> bool:
    """End the engine loop (it aborts what is left and tells the followers to stop).

    Returns False when the thread does not finish: after a peer died it can be stuck in a
    collective until the distributed timeout, and nothing useful is left for it to do.
    """
    engine.stopping.set()
    thread.join(timeout=5 if failed else timeout_s)
    if thread.is_alive():
        log.error("engine thread did not stop; exiting without it")
        return False
    return True


def close_quietly(*resources: Any) -> None:
    """Unmap shared memory (channel, allreduce buffers); names were unlinked at start-up."""
    for res in resources:
        try:
            if res is not None:
                res.close()
        except Exception:  # noqa: BLE001 - exiting anyway; a close error must not mask the code
            log.exception("closing %s failed", type(res).__name__)


def exit_now(code: int) -> None:
    """Exit without waiting for a stuck daemon thread (interpreter shutdown could block)."""
    logging.shutdown()
    os._exit(code)


def seconds_since_start() -> float:
    """Process age, for the start-up log (the /proc entry's ctime is the process start)."""
    try:
        return time.time() - os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return float("nan")


def run_follower(follow_plans: Callable[[], None], *resources: Any) -> int:
    """A follower rank: execute plans until rank 0's shutdown plan (0) or its death (1)."""
    ignore_stop_signals()
    try:
        follow_plans()
    except PeerGone as exc:
        log.error("%s", exc)
        return 1
    finally:
        close_quietly(*resources)
    log.info("shutdown plan received; exiting")
    return 0


def finish_leader(engine: Any, thread: threading.Thread, code: int, *resources: Any) -> int:
    """Rank 0 after the HTTP server stopped: stop the engine, free resources, pick the code."""
    if code != 0:
        # After a failure torchrun may SIGTERM this rank during the teardown below (it polls
        # its workers on its own clock, and the engine join can take seconds): say the outcome
        # while it is still ours to say.
        log.info("exiting with code %d", code)
    if not stop_engine(engine, thread, failed=code != 0):
        exit_now(1)
    close_quietly(*resources)
    final = code if engine.error is None else 1
    if final != code or code == 0:
        log.info("exiting with code %d", final)
    return final
