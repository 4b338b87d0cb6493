"""Who may call what: the API and admin keys, and the start-up check on the bind address.

tpserve serves on loopback by default. Binding any other address without an API key would let
anyone who can reach the port generate on the devices and, through ``/admin/*``, switch
backends and write profiler traces, so it is refused unless ``--allow-unauthenticated`` says
that is intended (a warning alone scrolls past in a launcher's log). ``/admin/*`` takes
``--admin-api-key`` when given, else the API key.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass

from tpserve.args import ServerArgs
from tpserve.errors import ConfigError

log = logging.getLogger("tpserve")
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True)
class Keys:
    api: str | None  # every route but the open ones
    admin: str | None  # /admin/*

    @property
    def any(self) -> bool:
        return self.api is not None or self.admin is not None


def resolve_keys(args: ServerArgs) -> Keys:
    api = args.api_key or os.environ.get("TPSERVE_API_KEY") or None
    admin = args.admin_api_key or os.environ.get("TPSERVE_ADMIN_API_KEY") or api
    return Keys(api, admin)


def is_loopback(host: str) -> bool:
    """True only for addresses no other machine can reach; hostnames other than localhost
    are not resolved (what they resolve to can change) and count as reachable."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_security(args: ServerArgs) -> None:
    """Refuse (ConfigError) to serve beyond loopback without a key, before anything loads."""
    if is_loopback(args.host):
        return
    keys = resolve_keys(args)
    if keys.api is not None:
        return
    if not args.allow_unauthenticated:
        raise ConfigError(
            f"--host {args.host} exposes the server beyond this machine without an API key: "
            "anyone who can reach the port could generate and use /admin/*. Set --api-key "
            "(and --admin-api-key), bind 127.0.0.1, or pass --allow-unauthenticated",
            flag="--api-key")
    log.warning("SERVING WITHOUT AN API KEY ON %s (--allow-unauthenticated): every client that "
                "can reach port %d may generate%s", args.host, args.port,
                "" if keys.admin else " and call /admin/* (reconfigure, write traces)")
