"""The conversation between the kernel and its cluster driver: the process that holds the kernel's
connection to a Ray cluster (``launch/cluster/driver.py``).

Ray's driver ends its own process when the cluster's head is gone for a minute, and aborts it on a
failed check in its C++ core; in a process of taas's own that costs the connection, not the notebook.
The kernel asks one thing at a time and waits for its answer (a run in the background asks from a thread of
its own, in turn with the notebook's cells): ``Done`` with the value (and, for a
run, which of its processes still run), or ``Failed`` with the error to raise in the kernel; ``Notice``
lines (the notebook's folder going to the cluster) may come before either, to show as they come.

``kind`` is each message's name in what taas says about it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import ClassVar, Union

from taas_magic.configurations import Catalog, Configuration
from taas_magic.wire.channel import Channel
from taas_magic.wire.events import Key
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.task import LoaderPlan, RankTask

CONTROL = "cluster-driver"  # the run id the driver's channel's messages carry


# -- kernel → driver: the cluster ------------------------------------------------------------------
@dataclass(frozen=True)
class Connect:
    """Connect to the cluster at ``address``; warm agents unused for ``idle_seconds`` leave. The first message."""

    kind: ClassVar[str] = "connect"
    address: str
    idle_seconds: float


@dataclass(frozen=True)
class Describe:
    """The cluster's nodes by configuration, free or busy, and the warm agents, as ``%taas cluster`` shows them."""

    kind: ClassVar[str] = "describe"
    catalog: Catalog


@dataclass(frozen=True)
class Release:
    """End the warm agents but those on the nodes (ids) in ``keep``: answered (ended, kept)."""

    kind: ClassVar[str] = "release"
    keep: frozenset[str]


@dataclass(frozen=True)
class Ship:
    """A run's payload into the cluster's object store, and the notebook ``folder`` into its GCS as a
    package (one line if it is too large to travel); the tensors' memory file comes beside it. Answered
    with the payload's number."""

    kind: ClassVar[str] = "ship"
    task: RankTask
    data: bytes  # the shipped names' pickle
    tensors_size: int
    aliases: tuple[str, ...]
    folder: str


@dataclass(frozen=True)
class Drop:
    """The run that was to use payload ``payload`` has started or will not: the object store may let it go."""

    kind: ClassVar[str] = "drop"
    payload: int


@dataclass(frozen=True)
class StartOnNodes:
    """Place run ``run_id`` on ``nodes`` whole nodes of ``configuration`` (and a ``producer_node`` for each
    producer of ``loaders``), start its agents and its ranks there with ``envs`` over payload ``payload``;
    a new agent must run the kernel's ``versions`` (Python, torch, taas). Answered with the ids of the
    run's nodes."""

    kind: ClassVar[str] = "start"
    run_id: str
    payload: int
    configuration: Configuration
    nodes: int
    producer_node: Configuration | None
    envs: dict[int, dict[str, str]]
    loaders: tuple[LoaderPlan, ...]
    profile: str | None
    versions: tuple[str, str, str]
    keep: bool = False  # a session: it goes on without a lost node (but node 0)


# -- kernel → driver: one run (the RankGroup contract) ----------------------------------------------
@dataclass(frozen=True)
class Poll:
    """The run's events, waiting up to ``timeout`` seconds for some."""

    kind: ClassVar[str] = "poll"
    run_id: str
    timeout: float


@dataclass(frozen=True)
class Signal:
    """Send ``signum`` to some processes of the run (None: every one still running)."""

    kind: ClassVar[str] = "signal"
    run_id: str
    signum: int
    keys: tuple[Key, ...] | None


@dataclass(frozen=True)
class AskStacks:
    """Each of ``keys``' stacks, waiting up to ``timeout`` seconds."""

    kind: ClassVar[str] = "stacks"
    run_id: str
    keys: tuple[Key, ...]
    timeout: float


@dataclass(frozen=True)
class RunCell:
    """A session's next cell for ``ranks``; its tensors' memory file comes beside it, when it has any. ``folder``:
    the notebook's folder now, whose changes since the session began are told (its ranks keep their copy).
    Answered with the ids of the nodes the run holds now (a shrink may give some back)."""

    kind: ClassVar[str] = "cell"
    run_id: str
    cell: SessionCell
    ranks: tuple[int, ...]
    folder: str


@dataclass(frozen=True)
class Grow:
    """`%taas resize` to more ranks: a session's new ranks started on their nodes, waiting for the cell that
    heals them; ``world`` ranks on ``nodes`` nodes in all. Answered with the ids of the nodes the run holds now
    (a resize may add some); a one-line refusal where the nodes are not there."""

    kind: ClassVar[str] = "grow"
    run_id: str
    world: int
    nodes: int


@dataclass(frozen=True)
class AskPull:
    """`%taas pull` while a session's cell runs in the background: node 0 puts the request in the run's store,
    then ``ranks`` are told to answer it between two steps (``rank/pulling.py``)."""

    kind: ClassVar[str] = "pull"
    run_id: str
    number: int
    names: tuple[str, ...]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class AnswerLine:
    """A line typed in the notebook for a rank's debugger prompt (None: end of input)."""

    kind: ClassVar[str] = "line"
    run_id: str
    key: Key
    line: str | None


@dataclass(frozen=True)
class CloseRun:
    """End every node's share of the run and release its nodes; answered with rank 0's files (``RunFiles``)
    and whether an interrupt came meanwhile. A run the driver no longer has is answered None."""

    kind: ClassVar[str] = "close"
    run_id: str


# -- driver → kernel ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Notice:
    """A line for the cell's stderr, while the kernel waits for an answer."""

    kind: ClassVar[str] = "notice"
    line: str


@dataclass(frozen=True)
class Done:
    """The answer: ``value``, and for a message about a run, which of its processes still run."""

    kind: ClassVar[str] = "done"
    value: object
    running: frozenset[Key] = frozenset()


@dataclass(frozen=True)
class Failed:
    """What was asked raised ``error`` (an interrupt the kernel passed on included): the kernel raises it."""

    kind: ClassVar[str] = "failed"
    error: BaseException
    running: frozenset[Key] = frozenset()


ToDriver = Union[
    Connect,
    Describe,
    Release,
    Ship,
    Drop,
    StartOnNodes,
    Poll,
    Signal,
    AskStacks,
    RunCell,
    Grow,
    AskPull,
    AnswerLine,
    CloseRun,
]
FromDriver = Union[Notice, Done, Failed]

# Who sends what to whom: docs/architecture.md's table of messages lists exactly these (test_protocol.py).
DIRECTIONS = (("kernel", "cluster driver", ToDriver), ("cluster driver", "kernel", FromDriver))

KernelEnd = Channel[ToDriver, FromDriver]
DriverEnd = Channel[FromDriver, ToDriver]


def kernel_end(sock: socket.socket, secret: bytes) -> KernelEnd:
    return Channel(sock, secret, CONTROL, receives=FromDriver)


def driver_end(sock: socket.socket, secret: bytes) -> DriverEnd:
    return Channel(sock, secret, CONTROL, receives=ToDriver)
