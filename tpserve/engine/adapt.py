"""Rank 0's side of adaptive speculation: ask the chooser before each step, send its choice
to every rank as a ``ConfigChange`` (the live-switch path), and time each decode step's
phases for it. The chooser itself (``spec/adaptive.py``) knows nothing about the engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from tpserve.args import ServerArgs
from tpserve.engine.admin import AdminError
from tpserve.engine.messages import ConfigChange, SpecSettings
from tpserve.errors import ConfigError
from tpserve.spec.adaptive import OFF, AdaptiveChooser, Setting, candidates
from tpserve.spec.decoder import SpecDecoder

MODES = ("on", "off")


def make_driver(args: ServerArgs, spec: SpecDecoder | None, lookahead: int,
                static: Any) -> AdaptiveDriver | None:
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
    return AdaptiveDriver(AdaptiveChooser(launch, candidates(launch, lookahead,
                                                             static is not None)))


def current_setting(spec: SpecDecoder) -> Setting:
    if not spec.enabled:
        return OFF  # asked every plain step at 8 clients: no settings object built for it
    cfg = spec.cfg
    return Setting(cfg.num_steps, cfg.topk, cfg.num_draft_tokens)


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


@dataclass
class AdaptiveDriver:
    """The chooser plus what the engine needs around it: whether it drives the settings now
    (an explicit admin setting pins them until re-enabled) and this step's phase times."""

    chooser: AdaptiveChooser
    on: bool = True
    phases: dict[str, float] = field(default_factory=dict)
    carry: float = 0.0  # seconds of prompt-only steps since the last decode step
    previous: Setting | None = None  # the setting of the last decode step observed

    def phase(self, inner: AbstractContextManager[None], name: str
              ) -> AbstractContextManager[None]:
        return clocked(inner, self.phases, name)

    def record(self, name: str, seconds: float) -> None:
        """Time measured inside another part of the step (the draft feed within a forward)."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def change_for(self, spec: SpecDecoder, running: int,
                   followed: bool = True) -> ConfigChange | None:
        """Before a step over ``running`` requests: the change every rank must apply for the
        chooser's setting (None: keep the current one). Unless the draft ``followed`` every
        running request, plain decoding is the only choice."""
        if not self.on or not running:
            return None
        choice = self.chooser.choose(running) if followed else self.chooser.step_aside(running)
        if choice == current_setting(spec):
            return None
        return ConfigChange(speculative=settings_for(choice, spec))

    def observe(self, setting: Setting, kind: str, batch: int, seconds: float,
                appended: int, stalled: bool = True, fed: bool = True) -> None:
        """After a step of ``kind`` with ``batch`` decoding requests: its wall time, forward
        and draft time, tokens appended, whether it ``fed`` the draft.

        Prompt work costs every setting about alike: prompt chunks ride in mixed steps,
        whose running requests decode plainly whatever the setting, so a mixed step is not
        measured (its time is mostly its chunk: one 66 ms mixed step among 5 ms decode steps
        made plain decoding look 1.5x slower than it was at 8 clients on the demo pair).
        Without mixing (``--disable-mixed-chunk``) a prefill-only step that ``stalled``
        running requests adds its time to the next decode step's (one with nothing else
        running costs every setting alike). A decode step under another setting than the
        last one pays for the switch and is not timed (``AdaptiveChooser.observe``)."""
        if not self.on:
            self.carry, self.previous = 0.0, None
        elif kind == "prefill" or not batch:
            self.carry += seconds if stalled else 0.0
        elif kind == "mixed":
            pass
        else:
            ph = self.phases
            forward = ph.get("decode" if setting.off else "verify", 0.0)
            # A plain step's draft time is what feeding the draft cost it.
            # With one drafting rank, rank 0 waits for its tree in the "tree" phase.
            draft = (ph.get("draft", 0.0) + ph.get("tree", 0.0) if not setting.off
                     else ph.get("feed", 0.0))
            switched = self.previous is not None and setting != self.previous
            self.previous = setting
            self.chooser.observe(setting, batch, 1e3 * (seconds + self.carry), 1e3 * forward,
                                 1e3 * draft, appended, fed, switched)
            self.carry = 0.0
        self.phases = {}

    def take(self, change: dict[str, Any]) -> dict[str, Any]:
        """An admin change: ``speculative.adaptive`` turns the chooser on or off; any other
        speculative setting without it pins the settings (so an A/B arm measures what it
        set). Returns the change without the ``adaptive`` key."""
        body = change.get("speculative")
        if not isinstance(body, dict):
            return change
        if "adaptive" not in body:
            self.on = False
            return change
        self.on = bool(body["adaptive"])
        return without_adaptive(change, body)

    def forget(self) -> None:
        """Drop every measurement (after the warm-up); on/off stays as it is."""
        self.chooser.reset()
        self.phases, self.carry = {}, 0.0

    def snapshot(self) -> dict[str, Any]:
        return {"enabled": self.on, **self.chooser.snapshot()}


def take_adaptive(driver: AdaptiveDriver | None, change: dict[str, Any]) -> dict[str, Any]:
    """``AdaptiveDriver.take`` where one was set up; without one, asking for it is an error."""
    if driver is not None:
        return driver.take(change)
    body = change.get("speculative")
    if isinstance(body, dict) and body.get("adaptive"):
        raise AdminError("adaptive speculation was not set up at launch (it needs a draft "
                         "and --speculative-adaptive on)")
    if isinstance(body, dict) and "adaptive" in body:
        return without_adaptive(change, body)
    return change


def without_adaptive(change: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """``change`` with ``speculative.adaptive`` removed (None when nothing else is left)."""
    rest = {k: v for k, v in body.items() if k != "adaptive"}
    return {**change, "speculative": rest or None}
