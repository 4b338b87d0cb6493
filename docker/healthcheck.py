#!/usr/bin/env python3
"""The images' HEALTHCHECK: exit 0 when this container's tpserve answers ``GET /health`` 200.

The address comes from the server's own command line (``--host`` / ``--port``, read from
``/proc/1/cmdline``, the container's first process: the entrypoint, or the init that runs
it), so a run with ``--port 8000`` needs no second setting. A wildcard bind (``0.0.0.0``,
``::``) is probed on loopback. In a multi-node job (``NNODES`` > 1 or ``NODE_RANK`` > 0) only
the node that torchrun's c10d rendezvous gave global rank 0 serves HTTP, and which node that
is the rendezvous decides, not ``NODE_RANK``: so there, nothing listening on the port means
another node serves and the check passes, while a server that answers must answer 200.

Standard library only: it must run with whichever ``python3`` the image has.
Usage: ``healthcheck.py`` (reads /proc/1/cmdline) or ``healthcheck.py -- SERVER ARGS...``.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
WILDCARDS = {"", "0.0.0.0", "::", "[::]"}
TIMEOUT_S = 5.0


def flag_value(argv: list[str], name: str) -> str | None:
    """The last value given for ``name`` (``--name V`` or ``--name=V``), as argparse keeps it."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg[len(name) + 1:]
    return value


def health_url(argv: list[str]) -> str:
    host = flag_value(argv, "--host")
    host = DEFAULT_HOST if host is None or host in WILDCARDS else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal in a URL
    port = int(flag_value(argv, "--port") or DEFAULT_PORT)
    return f"http://{host}:{port}/health"


def first_process_args() -> list[str]:
    raw = Path("/proc/1/cmdline").read_bytes()
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def probe(url: str) -> tuple[bool | None, str]:
    """(True: 200, False: another answer or a timeout, None: nothing listening, detail)."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            return reply.status == 200, f"{url}: {reply.status}"
    except urllib.error.HTTPError as exc:  # 503 while starting, shutting down or failed
        return False, f"{url}: {exc.code} {exc.read(200).decode(errors='replace')}"
    except urllib.error.URLError as exc:
        refused = isinstance(exc.reason, ConnectionRefusedError)
        return (None if refused else False), f"{url}: {exc.reason}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"


def multi_node() -> bool:
    return (os.environ.get("NNODES", "1") not in ("", "1")
            or os.environ.get("NODE_RANK", "0") not in ("", "0"))


def main(argv: list[str]) -> int:
    server_args = argv[argv.index("--") + 1:] if "--" in argv else first_process_args()
    ok, detail = probe(health_url(server_args))
    if ok is None and multi_node():
        print(f"{detail} (multi-node job: HTTP is served by the node holding global rank 0)")
        return 0
    print(detail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
