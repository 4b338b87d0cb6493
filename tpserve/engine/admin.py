"""Live reconfiguration: switch the allreduce backend and speculative settings between steps.

Rank 0 validates a change, sends it to every rank as an ``admin`` plan through the same
control channel as the step plans, and applies it itself; followers apply it when they read
it. The plan stream is ordered, so every rank switches between the same two steps and no
collective is ever issued through two different backends.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpserve.dist import CommSwitch
from tpserve.spec.config import SpecConfig, check_tree_shape


class AdminError(ValueError):
    """A requested change is invalid or not possible with what was allocated at start."""


def validate_change(change: dict[str, Any], comm: CommSwitch | None, spec: Any,
                    lookahead: int) -> dict[str, Any]:
    """Normalise a /admin/config body into the change every rank applies; raises AdminError."""
    unknown = set(change) - {"allreduce", "speculative", "profiling", "reset_stats"}
    if unknown:
        raise AdminError(f"unknown admin setting(s): {', '.join(sorted(unknown))}")
    out: dict[str, Any] = {}
    if change.get("allreduce") is not None:
        name = change["allreduce"]
        known = list(comm.backends) if comm is not None else []
        if name not in known:
            raise AdminError(f"allreduce backend '{name}' was not initialised at launch "
                             f"(initialised: {', '.join(known) or 'none, TP=1'}); launch with "
                             f"--allreduce {','.join([*known, str(name)])}")
        out["allreduce"] = name
    if change.get("speculative") is not None:
        body = change["speculative"]
        if spec is None and body == {"enabled": False}:
            return out  # already off (no draft): a no-op, so a harness can send it to any server
        out["speculative"] = _spec_change(body, spec, lookahead)
    return out


def _spec_change(body: dict[str, Any], spec: Any, lookahead: int) -> dict[str, Any]:
    if spec is None:
        raise AdminError("speculative decoding needs a draft loaded at launch "
                         "(--speculative-algorithm EAGLE3)")
    allowed = {"enabled", "num_steps", "eagle_topk", "num_draft_tokens"}
    unknown = set(body) - allowed
    if unknown:
        raise AdminError(f"unknown speculative setting(s): {', '.join(sorted(unknown))}")
    cur: SpecConfig = spec.cfg
    new = SpecConfig(int(body.get("num_steps", cur.num_steps)),
                     int(body.get("eagle_topk", cur.topk)),
                     int(body.get("num_draft_tokens", cur.num_draft_tokens)))
    try:
        check_tree_shape(new)
    except SystemExit as exc:  # start-up checks exit; here they are a client error
        raise AdminError(str(exc).removeprefix("error: ")) from None
    if new.lookahead > lookahead:
        raise AdminError(f"this setting writes {new.lookahead} KV slots per step ahead of the "
                         f"sequence, but {lookahead} were reserved at launch; launch with a "
                         "larger --speculative-num-draft-tokens to allow it")
    return {"enabled": bool(body.get("enabled", spec_enabled(spec))), **dataclasses.asdict(new)}


def spec_enabled(spec: Any) -> bool:
    return spec is not None and getattr(spec, "enabled", True)


def apply_change(change: dict[str, Any], runner: Any, spec: Any) -> None:
    """Every rank: apply a validated change (between steps)."""
    comm: CommSwitch | None = runner.comm
    if "allreduce" in change and comm is not None and comm.active_name != change["allreduce"]:
        comm.set_active(change["allreduce"])
        hook = getattr(runner.static, "on_backend_change", None)
        if hook is not None:  # CUDA graphs captured the old backend's kernels
            hook()
    if "speculative" in change and spec is not None:
        s = change["speculative"]
        spec.enabled = s["enabled"]
        new = SpecConfig(s["num_steps"], s["topk"], s["num_draft_tokens"])
        if new != spec.cfg:
            spec.cfg = new
            # Captured/compiled verify and draft phases depend on the tree shape: let the
            # decoder drop just those (target decode graphs stay valid).
            hook = getattr(spec, "on_config_change", None)
            if hook is not None:
                hook()


def spec_settings(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {"enabled": spec_enabled(spec), "num_steps": spec.cfg.num_steps,
            "eagle_topk": spec.cfg.topk, "num_draft_tokens": spec.cfg.num_draft_tokens}
