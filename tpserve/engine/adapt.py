"""Rank 0's side of adaptive speculation: ask the chooser before each step, send its choice
to every rank as a ``ConfigChange`` (the live-switch path), and time each decode step's
phases for it. The chooser itself (``spec/adaptive.py``) knows nothing about the engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from tpserve.args import ServerArgs
from tpserve.engine.messages import SpecSettings
from tpserve.errors import ConfigError
from tpserve.spec.adaptive import OFF, AdaptiveChooser, Setting, candidates
from tpserve.spec.decoder import SpecDecoder

MODES = ("on", "off")


def make_chooser(args: ServerArgs, spec: SpecDecoder | None, lookahead: int,
                 static: Any) -> AdaptiveChooser | None:
    """The chooser when a draft is loaded and ``--speculative-adaptive on`` (the default).

    With captured / compiled forwards only the launch shape (and plain decoding) is allowed:
    another shape would mean a recapture or recompile on the hot path."""
    mode = str(args.speculative_adaptive).lower()
    if mode not in MODES:
        raise ConfigError(f"--speculative-adaptive must be on or off, got '{mode}'",
                          "--speculative-adaptive")
    if spec is None or mode == "off":
        return None
    cfg = spec.cfg
    launch = Setting(cfg.num_steps, cfg.topk, cfg.num_draft_tokens)
    return AdaptiveChooser(launch, candidates(launch, lookahead, static is not None))


def current_setting(spec: SpecDecoder) -> Setting:
    s = spec.settings()
    return Setting(s.num_steps, s.topk, s.num_draft_tokens) if s.enabled else OFF


def settings_for(choice: Setting, spec: SpecDecoder) -> SpecSettings:
    """What every rank applies; stepping aside keeps the tree shape (nothing to rebuild)."""
    if choice.off:
        return dataclasses.replace(spec.settings(), enabled=False)
    return SpecSettings(True, choice.steps, choice.topk, choice.tokens)


@contextmanager
def clocked(inner: AbstractContextManager[None], sink: dict[str, float],
            name: str) -> Iterator[None]:
    """``inner`` (the profiler's phase), also adding the wall time to ``sink[name]``; the
    chooser needs draft / forward times on every step, profiling on or off."""
    start = time.perf_counter()
    with inner:
        yield
    sink[name] = sink.get(name, 0.0) + time.perf_counter() - start


def observe_step(chooser: AdaptiveChooser, setting: Setting, batch: int, seconds: float,
                 phases: dict[str, float], appended: int) -> None:
    forward = phases.get("verify", 0.0) if not setting.off else phases.get("decode", 0.0)
    chooser.observe(setting, batch, 1e3 * seconds, 1e3 * forward,
                    1e3 * phases.get("draft", 0.0), appended)
