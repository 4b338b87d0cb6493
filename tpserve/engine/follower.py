"""What every rank does with each step message (rank 0 runs the same code for its own shard).

Followers loop in ``follow``: receive a message, dispatch on its type, repeat until
``Shutdown``. Their allreduces pair with rank 0's because every rank executes the same
messages in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from tpserve.dist import CommSwitch
from tpserve.engine.admin import apply_change
from tpserve.engine.messages import (
    AsGuessed,
    Committed,
    ConfigChange,
    ForwardStep,
    Guessed,
    Shutdown,
    SpecCommit,
    SpecStep,
    StepMessage,
    decode,
)
from tpserve.engine.plain_guess import GuessMissed, next_step
from tpserve.engine.plan import plan_fingerprint
from tpserve.engine.runner import ForwardOutput, ModelRunner
from tpserve.spec.decoder import SpecDecoder
from tpserve.spec.drafter import PhaseScope


class Channel(Protocol):
    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...


def run_forward(runner: ModelRunner, spec: SpecDecoder | None, step: ForwardStep,
                host_work: Callable[[], None] | None = None) -> ForwardOutput:
    """A forward step; with a draft loaded it also feeds the draft (so speculation can be
    switched on live for requests that are already running). ``host_work``: see
    ``ModelRunner.forward``."""
    if step.feed is not None:
        if spec is None:
            raise RuntimeError("a step fed the draft, but this rank has no draft model")
        return spec.feed(step, host_work)
    return runner.forward(step, step.logit_rows, host_work=host_work, greedy=step.greedy)


def tag_allreduces(comm: CommSwitch | None) -> PhaseScope:
    """A follower's phase scope: it only tags its allreduces (rank 0 does the timing)."""
    def scope(name: str) -> AbstractContextManager[None]:
        if comm is not None:
            comm.set_phase(name)
        return nullcontext()

    return scope


def receive(channel: Channel) -> StepMessage:
    return decode(channel.recv())


def follow(runner: ModelRunner, channel: Channel, spec: SpecDecoder | None = None) -> None:
    """Non-zero ranks: execute messages until rank 0 sends ``Shutdown``."""
    scope = tag_allreduces(runner.comm)
    # A message already received: bundled with the last commit, or the one that ended a run
    # of guessed plain steps (``run_guessed``).
    msg: StepMessage | None = None
    while True:
        msg = receive(channel) if msg is None else msg
        if spec is not None and not isinstance(msg, SpecStep):
            spec.discard_ahead()  # a tree grown ahead was for the next speculative step
        if isinstance(msg, Shutdown):
            return
        if runner.comm is not None:
            runner.comm.check()
        if isinstance(msg, ForwardStep):
            msg = run_guessed(runner, channel, msg, run_forward(runner, spec, msg))
            continue
        elif isinstance(msg, SpecStep):
            if spec is None:
                raise RuntimeError("a speculative step arrived, but this rank has no draft")
            verified = spec.run(msg, scope)
            spec.run_ahead(msg, verified)
            reply = receive(channel)
            commit, then = (spec.guessed(reply.fingerprint, reply.page_table)
                            if isinstance(reply, Guessed)
                            else split_commit(reply))
            spec.commit(msg, commit, verified)
            msg = then
            continue
        elif isinstance(msg, ConfigChange):
            apply_change(msg, runner.comm, runner.static, spec)
        else:
            raise RuntimeError(f"unexpected step message {type(msg).__name__}")
        msg = None


def run_guessed(runner: ModelRunner, channel: Channel, step: ForwardStep,
                out: ForwardOutput) -> StepMessage | None:
    """After a greedy plain step, each step it leads to (``plain_guess.next_step``), prepared
    before rank 0's word and run for as long as rank 0 confirms it; the message that ended
    the run (None: none received yet)."""
    while out.picks is not None:
        guess = next_step(step, out.picks[0], runner.page_size)
        if guess is None:
            return None
        try:
            out = run_forward(runner, None, guess, Confirm(channel, guess, runner.comm))
        except GuessMissed as missed:
            return missed.msg
        step = guess
    return None


class Confirm:
    """A guessed step's ``HostWork``: rank 0's word, as the forward reaches its first
    collective. ``AsGuessed``: go on; any other message: ``GuessMissed`` (nothing of the
    guessed step has reached the KV cache or another rank). A forward that ran a collective
    first would have paired it with whatever rank 0 runs: that fails loudly here."""

    def __init__(self, channel: Channel, guess: ForwardStep, comm: CommSwitch | None) -> None:
        self.channel, self.comm = channel, comm
        self.fingerprint = plan_fingerprint(guess)
        self.calls = self._calls()

    def _calls(self) -> int:
        return self.comm.active.stats.calls if self.comm is not None else 0

    def __call__(self) -> None:
        if self._calls() != self.calls:
            raise RuntimeError("a guessed step ran a collective before rank 0 confirmed it")
        msg = receive(self.channel)
        if not isinstance(msg, AsGuessed):
            raise GuessMissed(msg)
        if msg.fingerprint != self.fingerprint:
            raise RuntimeError("rank 0 confirmed a step this rank guessed otherwise "
                               f"(fingerprint {msg.fingerprint} vs {self.fingerprint})")


def split_commit(msg: StepMessage) -> tuple[SpecCommit, StepMessage | None]:
    """The commit a speculative step waits for, and the message bundled with it (if any)."""
    if isinstance(msg, Committed):
        return msg.commit, msg.then
    if isinstance(msg, SpecCommit):
        return msg, None
    raise RuntimeError(f"expected SpecCommit after SpecStep, got {type(msg).__name__}")
