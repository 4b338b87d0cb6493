#!/usr/bin/env python3
"""The images' HEALTHCHECK: exit 0 when this container's tpserve answers ``GET /health`` 200.

The address comes from the server's own command line (``--host`` / ``--port``, read from
``/proc/1/cmdline``, the container's first process: the entrypoint, or the init that runs
it), so a run with ``--port 8000`` needs no second setting. A wildcard bind (``0.0.0.0``,
``::``) is probed on loopback. Only node 0 serves HTTP in a multi-node job, so on a node with
``NODE_RANK`` > 0 there is nothing to probe and the check passes.

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


def probe(url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            return reply.status == 200, f"{url}: {reply.status}"
    except urllib.error.HTTPError as exc:  # 503 while starting, shutting down or failed
        return False, f"{url}: {exc.code} {exc.read(200).decode(errors='replace')}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"


def main(argv: list[str]) -> int:
    if os.environ.get("NODE_RANK", "0") not in ("", "0"):
        print(f"node {os.environ['NODE_RANK']}: HTTP is served by node 0")
        return 0
    server_args = argv[argv.index("--") + 1:] if "--" in argv else first_process_args()
    ok, detail = probe(health_url(server_args))
    print(detail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
