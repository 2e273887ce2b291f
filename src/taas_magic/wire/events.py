"""The events a running group of ranks reports, as every backend hands them to the kernel.

Each names the process it is about (a rank's number or a data producer) and carries plain data only:
they cross from a supervisor or a cluster agent to the kernel, so nothing in them is a local handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from taas_magic.wire.records import Record
from taas_magic.wire.results import Received


@dataclass(frozen=True)
class Producer:
    """A data producer among a run's processes: producer ``index`` of the ``loader``-th registered
    loader the cell uses. Ranks are keyed by their rank number; producers are not ranks."""

    loader: int
    index: int


Key = Union[int, Producer]  # a process of a run: a rank's number, or a producer


def key_order(key: Key) -> tuple[int, int, int]:
    """Ranks first, by number, then producers, by loader and index: a sort key for mixed keys."""
    return (0, key, 0) if isinstance(key, int) else (1, key.loader, key.index)


@dataclass(frozen=True)
class Output:
    """Bytes a rank or producer (or anything it started) wrote to its stdout or stderr."""

    rank: Key
    stream: str  # "stdout" or "stderr"
    data: bytes


@dataclass(frozen=True)
class Report:
    """A record a rank or producer sent about itself (``records.py``): how its cell ended, delivery
    progress, a notice."""

    rank: Key
    record: Record


@dataclass(frozen=True)
class Result:
    """A rank's top-level names, sent once after the cell's code succeeded (rank 0's, or those of the ranks
    ``--from`` names): ``results.Packed``'s bytes (names small enough for a message), or the names'
    file as received (``results.Received``: its large spans mapped, which the names then view)."""

    rank: Key  # always a rank: producers send no names
    data: bytes | Received
    pull: int = 0  # > 0: the names a `%taas pull` took while the cell ran (the pull's number), not the cell's end


@dataclass(frozen=True)
class ResultInFile:
    """A rank's names in a memory file, handed on by descriptor from the rank through its supervisor to the
    process that ends the run (the kernel, or a cluster node's agent), which maps it: nobody on the way
    copies the bytes. The rank sealed the file (``memfile.seal``): its contents cannot change once sent.
    The file travels with the message that carries this event; the receiving end makes it a ``Result``."""

    rank: Key
    size: int
    fd: int = -1  # in the supervisor: the file, until the message that carries it is sent
    pull: int = 0  # as ``Result.pull``


# An exit status no process has: a cluster session's rank whose node was lost (its driver says so), the session
# going on without that node's ranks.
NODE_LOST = 1 << 16


@dataclass(frozen=True)
class Exited:
    """A rank or producer is gone; its output and reports have all been delivered before this event."""

    rank: Key
    returncode: int  # as subprocess reports it: negative for death by a signal


@dataclass(frozen=True)
class InputRequest:
    """A rank waits for a line of input (its debugger's prompt): answered with ``RankGroup.answer``."""

    rank: Key
    prompt: str


Event = Union[Output, Report, Result, Exited, InputRequest]
Relayed = Union[Event, ResultInFile]  # what a run's supervisor sends its kernel: a file becomes a Result there
