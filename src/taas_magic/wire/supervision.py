"""The conversation between whoever started a run (the kernel, or a cluster node's agent) and the
run's supervisor, on the run's own channel.

Requests go one way: ``Go`` first (the notebook's names for the functions ranks replace, found
while the supervisor forks), then any of ``SignalRanks``, ``AskStacks``, a session's ``RunCell``
(its tensors' memory file beside it), ``PutInStore`` where the supervisor serves the run's store, a debugger's
``AnswerLine``, and ``Close``. The supervisor
answers ``Started`` or ``StartFailed``, then sends ``Events`` and ``Stacks`` as they come, and
``Closed`` last, with the events that came with the end, once every process of the run has exited
or it was asked to close; ``Lost`` instead when it had to end the run on its own.

``kind`` is each message's name in what taas says about it ("could not send 'signal': …").
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import ClassVar, Union

from taas_magic.wire.channel import Channel
from taas_magic.wire.events import Key, Relayed
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.task import NodeDeliveryEnds


# -- kernel → supervisor ------------------------------------------------------------------------
@dataclass(frozen=True)
class Go:
    """Let the forked processes go; ``aliases``: the notebook's names for the functions ranks replace."""

    kind: ClassVar[str] = "go"
    aliases: tuple[str, ...]


@dataclass(frozen=True)
class SignalRanks:
    """Send ``signum`` to these processes of the run (None: every one still running)."""

    kind: ClassVar[str] = "signal"
    signum: int
    ranks: tuple[Key, ...] | None


@dataclass(frozen=True)
class AskStacks:
    """Ask these processes for their threads' stacks; answered by ``Stacks`` within ``timeout``."""

    kind: ClassVar[str] = "stacks"
    ranks: tuple[Key, ...]
    timeout: float


@dataclass(frozen=True)
class RunCell:
    """A session's next cell, for some of its ranks; on a cluster's node, with the node's share of the loaders the
    cell begins to serve (``delivery``: which of the descriptors that come last with it is what)."""

    kind: ClassVar[str] = "cell"
    cell: SessionCell
    ranks: tuple[int, ...]
    delivery: NodeDeliveryEnds | None = None


@dataclass(frozen=True)
class PutInStore:
    """Set ``key`` to ``value`` in the run's store, which this supervisor serves (a cluster run's node 0): what its
    ranks read when told to (a pull's request), put before any rank is told. Answered by ``Stored``."""

    kind: ClassVar[str] = "put"
    key: str
    value: str


@dataclass(frozen=True)
class AnswerLine:
    """A line typed in the notebook for a rank's debugger prompt (None: end of input)."""

    kind: ClassVar[str] = "line"
    rank: Key
    line: str | None


@dataclass(frozen=True)
class Close:
    """End the run: the supervisor answers ``Closed`` once every process of it is gone."""

    kind: ClassVar[str] = "close"


# -- supervisor → kernel ------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """The run's processes are forked: the supervisor's process id, and every process's key."""

    kind: ClassVar[str] = "started"
    pid: int
    processes: tuple[Key, ...]


@dataclass(frozen=True)
class StartFailed:
    """The ranks could not be started (the task could not be unpacked, say): why, in one line."""

    kind: ClassVar[str] = "failed"
    reason: str


@dataclass(frozen=True)
class Events:
    """What the run's processes did since the last ``Events``."""

    kind: ClassVar[str] = "events"
    events: tuple[Relayed, ...]


@dataclass(frozen=True)
class Stacks:
    """The answer to ``AskStacks``: each process's stacks, as faulthandler wrote them."""

    kind: ClassVar[str] = "stacks"
    stacks: dict[Key, str]


@dataclass(frozen=True)
class Stored:
    """The answer to ``PutInStore``: the value is in the run's store (``done``; False where this supervisor serves
    none), so that a rank told of it afterwards, through another node, reads it and not the one before."""

    kind: ClassVar[str] = "stored"
    key: str
    done: bool


@dataclass(frozen=True)
class Closed:
    """Every process of the run is gone: their exit codes, and the events that came with the end."""

    kind: ClassVar[str] = "closed"
    codes: dict[Key, int]
    last: tuple[Relayed, ...]


@dataclass(frozen=True)
class Lost:
    """The supervisor ended the run on its own (its parent died, the session was idle): why."""

    kind: ClassVar[str] = "lost"
    why: str


ToSupervisor = Union[Go, SignalRanks, AskStacks, RunCell, PutInStore, AnswerLine, Close]
FromSupervisor = Union[Started, StartFailed, Events, Stacks, Stored, Closed, Lost]

# Who sends what to whom: docs/architecture.md's table of messages lists exactly these (test_protocol.py).
DIRECTIONS = (("kernel or agent", "supervisor", ToSupervisor), ("supervisor", "kernel or agent", FromSupervisor))

KernelEnd = Channel[ToSupervisor, FromSupervisor]
SupervisorEnd = Channel[FromSupervisor, ToSupervisor]


def kernel_end(sock: socket.socket, secret: bytes, run_id: str) -> KernelEnd:
    """The end of whoever started the run: the kernel, or a cluster node's agent."""
    return Channel(sock, secret, run_id, receives=FromSupervisor)


def supervisor_end(sock: socket.socket, secret: bytes, run_id: str) -> SupervisorEnd:
    return Channel(sock, secret, run_id, receives=ToSupervisor)
