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
    msg: StepMessage | None = None  # a message that came bundled with the last commit
    while True:
        msg = receive(channel) if msg is None else msg
        if spec is not None and not isinstance(msg, SpecStep):
            spec.discard_ahead()  # a tree grown ahead was for the next speculative step
        if isinstance(msg, Shutdown):
            return
        if runner.comm is not None:
            runner.comm.check()
        if isinstance(msg, ForwardStep):
            run_forward(runner, spec, msg)
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


def split_commit(msg: StepMessage) -> tuple[SpecCommit, StepMessage | None]:
    """The commit a speculative step waits for, and the message bundled with it (if any)."""
    if isinstance(msg, Committed):
        return msg.commit, msg.then
    if isinstance(msg, SpecCommit):
        return msg, None
    raise RuntimeError(f"expected SpecCommit after SpecStep, got {type(msg).__name__}")
