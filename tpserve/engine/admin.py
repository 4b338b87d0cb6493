"""Live reconfiguration: switch the allreduce backend and speculative settings between steps.

Rank 0 validates a change, sends it to every rank as a ``ConfigChange`` message through the
same control channel as the steps, and applies it itself; followers apply it when they read
it. The message stream is ordered, so every rank switches between the same two steps and no
collective is ever issued through two different backends.
"""

from __future__ import annotations

from typing import Any

from tpserve.dist import CommSwitch
from tpserve.engine.messages import ConfigChange, SpecSettings
from tpserve.errors import ConfigError
from tpserve.spec.config import SpecConfig, check_tree_shape
from tpserve.spec.decoder import SpecDecoder

SETTINGS = {"allreduce", "speculative", "profiling", "reset_stats"}
SPEC_SETTINGS = {"enabled", "num_steps", "eagle_topk", "num_draft_tokens"}


class AdminError(ValueError):
    """A requested change is invalid or not possible with what was allocated at start."""


def validate_change(change: dict[str, Any], comm: CommSwitch | None, spec: SpecDecoder | None,
                    lookahead: int) -> ConfigChange | None:
    """Normalise a /admin/config body into what every rank applies (None: nothing to send)."""
    unknown = set(change) - SETTINGS
    if unknown:
        raise AdminError(f"unknown admin setting(s): {', '.join(sorted(unknown))}")
    allreduce = change.get("allreduce")
    if allreduce is not None:
        known = list(comm.backends) if comm is not None else []
        if allreduce not in known:
            raise AdminError(f"allreduce backend '{allreduce}' was not initialised at launch "
                             f"(initialised: {', '.join(known) or 'none, TP=1'}); launch with "
                             f"--allreduce {','.join([*known, str(allreduce)])}")
    speculative = None
    body = change.get("speculative")
    if body is not None and not (spec is None and body == {"enabled": False}):
        # Turning speculation off where no draft is loaded is a no-op, so a harness can send
        # it to any server.
        speculative = _spec_change(body, spec, lookahead)
    if allreduce is None and speculative is None:
        return None
    return ConfigChange(allreduce=allreduce, speculative=speculative)


def _spec_change(body: dict[str, Any], spec: SpecDecoder | None, lookahead: int) -> SpecSettings:
    if spec is None:
        raise AdminError("speculative decoding needs a draft loaded at launch "
                         "(--speculative-algorithm EAGLE3)")
    unknown = set(body) - SPEC_SETTINGS
    if unknown:
        raise AdminError(f"unknown speculative setting(s): {', '.join(sorted(unknown))}")
    cur = spec.cfg
    new = SpecConfig(int(body.get("num_steps", cur.num_steps)),
                     int(body.get("eagle_topk", cur.topk)),
                     int(body.get("num_draft_tokens", cur.num_draft_tokens)))
    try:
        check_tree_shape(new)
    except ConfigError as exc:  # a start-up refusal; here it is a client error
        raise AdminError(str(exc)) from None
    if new.lookahead > lookahead:
        raise AdminError(f"this setting writes {new.lookahead} KV slots per step ahead of the "
                         f"sequence, but {lookahead} were reserved at launch; launch with a "
                         "larger --speculative-num-draft-tokens to allow it")
    return SpecSettings(bool(body.get("enabled", spec.enabled)), new.num_steps, new.topk,
                        new.num_draft_tokens)


def apply_change(change: ConfigChange, comm: CommSwitch | None, static: Any,
                 spec: SpecDecoder | None) -> None:
    """Every rank: apply a validated change (between steps)."""
    if change.allreduce is not None and comm is not None and comm.active_name != change.allreduce:
        comm.set_active(change.allreduce)
        hook = getattr(static, "on_backend_change", None)
        if hook is not None:  # CUDA graphs captured the old backend's kernels
            hook()
    if change.speculative is not None and spec is not None:
        spec.apply(change.speculative)


def spec_settings(spec: SpecDecoder | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    s = spec.settings()
    return {"enabled": s.enabled, "num_steps": s.num_steps, "eagle_topk": s.topk,
            "num_draft_tokens": s.num_draft_tokens}
