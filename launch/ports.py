"""A free loopback port for a server about to start (the tests', the benchmarks', the gate's).

The kernel picks it from the ephemeral range, which outgoing connections draw from too, so it
can be taken again before the server binds it: callers that must not fail on that relaunch on
a new port when the server reports "address already in use" (``tests/server_proc.py``,
``launch/gpu_serve_check.py``).
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
