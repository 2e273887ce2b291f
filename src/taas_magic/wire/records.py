"""What ranks and producers report about themselves: one dataclass per kind, and its wire form.

A process of a run writes its records as JSON lines on its report pipe (``encode``); the process
that reads the pipe turns each line back into its dataclass (``decode``), and from there on the
record travels, and is read, as a typed value. A line that is not a record of a known kind
becomes a ``Failed`` that says so: a process that garbles its reports has failed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class DeliverySummary:
    """How one registered loader fared in one rank."""

    taken: int  # elements the rank received
    waited: float  # seconds it spent waiting for them
    first_wait: float  # seconds until its first element
    span: float  # seconds from its first iter() to its last element


@dataclass(frozen=True)
class CellEnded:
    """The cell's code ended without an error in this rank."""

    time: float  # time.monotonic(): did it leave before another rank failed?
    skipped: dict[str, str] = field(default_factory=dict)  # names rank 0 could not send back, and why
    delivery: dict[str, DeliverySummary] = field(default_factory=dict)  # by loader name
    exited: str = ""  # "sys.exit(0)" when the cell ended by exiting early


@dataclass(frozen=True)
class Failed:
    """The cell's code (or a producer's loader) raised, or was interrupted."""

    time: float  # taken when the exception was caught: the earliest failure is the root cause
    ename: str
    evalue: str
    traceback: list[str] = field(default_factory=list)
    interrupted: bool = False  # a KeyboardInterrupt: taas's own, unless the cell raised it itself
    where: str = ""  # what a producer was doing: "at element 5 of pass 0 (samples …)"
    hint: str = ""  # advice for a mistake the rank recognized
    peer_lost: bool = False  # the error says another process of the run went away (gloo's "connection closed by peer")
    stack: str = ""  # where such a rank was (its error's frames, as faulthandler writes a stack)
    # A session cell's interrupt: the optimizer steps the cell applied in this rank (None: it began none), and
    # whether the rank stopped inside one (``rank/stopping.py``).
    steps: int | None = None
    inside_step: bool = False
    # A session rank cut its process groups' connections as it left the cell, so that no peer waits for it
    # (``rank/group_links.py``): the session connects the group anew before its next cell.
    left_group: bool = False


@dataclass(frozen=True)
class DeliveryProgress:
    """One registered loader's counters, as one process saw them at ``at``."""

    loader: str
    at: float
    produced: int
    taken: list[int]  # per rank
    skipped: list[int]  # per rank: elements passed over by a rank that stopped early
    buffered: int
    done: list[int]  # per rank: 1 once its cell ended
    waited: list[float] = field(default_factory=list)  # per rank: seconds its cell has waited for elements


@dataclass(frozen=True)
class SaveSkipped:
    """A ``torch.save`` in a rank other than 0, which taas skipped."""

    path: str


@dataclass(frozen=True)
class SavedOnNode:
    """Rank 0 of a cluster run saved outside its run folder: the file stays on that node."""

    path: str
    node: str  # the node's address


@dataclass(frozen=True)
class RankProgress:
    """A rank's own account of how far it got (``taas.progress``): its step and metrics at ``at``."""

    at: float
    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RankVitals:
    """What a rank's process holds at ``at``, sampled by the rank itself about once a second."""

    at: float
    memory: int  # resident bytes
    peak_memory: int  # the most resident bytes so far
    gpu_memory: int | None = None  # bytes in use on the rank's GPU (NVML), on CUDA runs
    gpu_utilization: int | None = None  # percent of the last sample period the GPU was busy


@dataclass(frozen=True)
class Collective:
    """A collective (or point-to-point) operation a rank has entered and not left, as torch's flight recorder saw it."""

    group: str  # its process group's name: "0" is the default group
    seq: int  # its number in that group's sequence of collectives (of sends and receives, for ``p2p``)
    op: str  # "all_reduce", "barrier", "broadcast", …
    shapes: list[list[int]]  # of its input tensors
    dtypes: list[str]  # of its input tensors: "Float", "Long", …
    seconds: float  # how long the rank had been in it when sampled
    p2p: bool = False


@dataclass(frozen=True)
class RankActivity:
    """What a rank's cell is doing at ``at``, sampled by the rank itself about once a second.

    The kernel reads progress from it (a collective finished, an element taken, CPU spent outside
    collectives) and, when none comes, where each rank waits.
    """

    at: float
    cpu: float  # CPU seconds the rank's process has spent, all its threads
    finished: dict[str, int] = field(
        default_factory=dict
    )  # its process groups -> the last collective each finished (-1: none)
    collectives: list[Collective] = field(default_factory=list)  # entered and not left, oldest first
    waiting: str = ""  # the registered loader whose next element the cell waits for
    waited: float = 0.0  # seconds it has waited for it so far
    taken: int = 0  # elements the cell took from registered loaders
    setup: float | None = None  # seconds in process-group setup (init_process_group), while in it
    store: str = ""  # where it meets the others in that setup: "host:port"


Record = Union[CellEnded, Failed, DeliveryProgress, SaveSkipped, SavedOnNode, RankProgress, RankVitals, RankActivity]
KINDS: dict[str, type] = {
    kind.__name__: kind
    for kind in (CellEnded, Failed, DeliveryProgress, SaveSkipped, SavedOnNode, RankProgress, RankVitals, RankActivity)
}


def encode(record: Record) -> bytes:
    """One line of JSON: the kind's name and its fields. Every rank writes a few each cell and each second:
    its dataclasses are read as they are (``default``), not deep-copied first as ``dataclasses.asdict`` would."""
    return (json.dumps({"kind": type(record).__name__, **_fields(record)}, default=_fields) + "\n").encode()


def _fields(value: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"a record holds {type(value).__name__}, which JSON cannot say")
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}


def decode(line: bytes) -> Record:
    try:
        fields: Any = json.loads(line)
        kind = KINDS[fields.pop("kind")]
        if kind is CellEnded:
            fields["delivery"] = {name: DeliverySummary(**summary) for name, summary in fields["delivery"].items()}
        elif kind is RankActivity:
            fields["collectives"] = [Collective(**collective) for collective in fields["collectives"]]
        record: Record = kind(**fields)
        return record
    except (ValueError, KeyError, TypeError, AttributeError):
        return Failed(0.0, "ProtocolError", f"unreadable report {line[:80]!r}")


# A rank that dumps its own stacks when asked (``rank/vitals.py``) first writes where its collectives are at that
# moment, as one line: the stacks and the position are then of one moment, which samples up to a second old are
# not (a rank in a fast training loop finishes hundreds of collectives a second).
POSITION = "taas position: "


def position_line(activity: RankActivity) -> bytes:
    """The line that precedes a rank's stacks: its activity at the moment they were dumped."""
    return POSITION.encode() + encode(activity)


def split_position(dump: str) -> tuple[RankActivity | None, str]:
    """A stack dump's position line, read (None when it has none, or one that does not read), and the dump
    without it."""
    if not dump.startswith(POSITION):
        return None, dump
    line, _, rest = dump.partition("\n")
    record = decode(line[len(POSITION) :].encode())
    return (record if isinstance(record, RankActivity) else None), rest
