"""The conversation between a run's supervisor and each of its ranks, on the rank's control channel.

A session's rank runs the cells it is sent (``SessionCell``, with its tensors' memory file and the
ends of the loaders it begins to serve beside it), says when it takes one (``InCell``: the
interrupts held for the cell go to it from then on) and when it ended (``CellEnd``). A rank's
debugger, in a session or at a ``breakpoint()``, asks for each line it reads (``Prompt``) and gets
what the notebook typed (``Line``). The kernel's side of a session's cells and lines goes through
the supervisor (``supervision.py``).

``kind`` is each message's name in what taas says about it.
"""

from __future__ import annotations

import json
import signal
import socket
from dataclasses import dataclass, field
from typing import ClassVar, Iterable, Union

from taas_magic.wire.channel import Channel
from taas_magic.wire.events import Key
from taas_magic.wire.task import CellOrder, LoaderPlan

# What a session's rank is sent first when its cell is interrupted (or its --timeout runs out): stop before the
# optimizer step every rank agrees on, the replicas equal (``rank/stopping.py``); SIGINT follows for ranks that
# do not get there. Before a rank takes its cell, it stands for an interrupt.
STOP_TOGETHER = signal.SIGUSR2
# What a session's rank is sent when the notebook pulls names while its cell runs in the background: answer
# before the optimizer step every rank agrees on (``rank/stopping.py``), the request in the run's store under
# ``PULL_KEY``; at once in a cell that has begun no step. Ignored outside a session's cell.
PULL_TOGETHER = signal.SIGRTMIN + 2
PULL_KEY = "taas/pull"  # {"number": N, "names": [...], "ranks": [...]} as JSON, one request at a time


def pull_request(number: int, names: tuple[str, ...], ranks: tuple[int, ...]) -> str:
    """What ``PULL_KEY`` holds for a pull (``rank/pulling.py`` reads it)."""
    return json.dumps({"number": number, "names": list(names), "ranks": list(ranks)})


@dataclass(frozen=True)
class Reload:
    """Which changed modules a rank reloads before a cell, as the kernel's autoreload did before it."""

    every: bool  # every changed module (%autoreload 2 or 3); else those in ``modules``
    modules: tuple[str, ...] = ()  # %aimport-ed, or reloaded in the kernel since the last cell (%autoreload now)
    skip: tuple[str, ...] = ()  # %aimport -NAME: never reloaded
    new_objects: bool = False  # %autoreload 3: names new in a module join the namespace too


# -- supervisor → rank ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SessionCell:
    """A cell for a session's ranks: what they do with it, and what they lack to do it: the notebook's
    names that changed since the last cell, and its new cells' code for tracebacks."""

    kind: ClassVar[str] = "cell"
    order: CellOrder  # its code None: open the debugger at the last cell's error instead
    names: bytes = b""  # shipped names (``shipping.pack``), empty when none changed
    tensors_size: int = 0  # the tensors' memory file comes with the message, when there is one
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)  # new cells, for tracebacks
    reload: Reload | None = None  # the modules to reload first, as the kernel's autoreload did (None: keep them)
    # The number of the first of the order's loaders among those the session serves: the supervisor starts
    # their producers, the ranks make their stand-ins.
    first_loader: int = 0
    number: int = 0  # the session's count of cells sent so far: it names the cell to its ranks (``rank/stopping.py``)
    regroup: bool = False  # connect the process group anew first: a rank left it as the last cell failed
    newcomers: tuple[int, ...] = ()  # new ranks (in place of dead ones, or added): they join the group, are healed
    world: int | None = None  # `%taas resize`, a lost node: the session's new number of ranks (those from it on end)
    nodes: int = 1  # the nodes the session's ranks are on, with ``world``

    @classmethod
    def post_mortem(cls) -> "SessionCell":
        """``%taas debug``: no code; the rank opens its debugger at its last cell's error."""
        return cls(CellOrder(None))

    @classmethod
    def reconnect(cls, number: int, newcomers: tuple[int, ...] = ()) -> "SessionCell":
        """No code: every rank connects its process group anew (``rank/group_links.py``), ``newcomers`` joining it,
        and they are given what the others hold alike (``rank/healing.py``). The supervisor starts them first."""
        return cls(CellOrder(None), number=number, regroup=True, newcomers=newcomers)

    @classmethod
    def resize(
        cls,
        number: int,
        world: int,
        size: int,
        nodes: int = 1,
        loaders: tuple[LoaderPlan, ...] = (),
        first_loader: int = 0,
    ) -> "SessionCell":
        """``%taas resize``: a session of ``size`` ranks becomes one of ``world`` (on ``nodes`` nodes): the
        supervisor ends ranks ``world`` and up, or starts the new ones; every rank then connects the process group
        anew, as ``world`` ranks, and the new ones are given what the others hold alike. The ``loaders`` it serves
        go on at their next pass, shared among ``world`` ranks by new producers (numbered from ``first_loader``).
        A cluster session that lost its last nodes goes on the same way, with the ranks of the nodes it has."""
        return cls(
            CellOrder(None, loaders=loaders),
            first_loader=first_loader,
            number=number,
            regroup=True,
            newcomers=tuple(range(size, world)),
            world=world,
            nodes=nodes,
        )

    def leaves(self, rank: object) -> bool:
        """Whether ``rank`` (a rank's number, or a producer) ends with this cell: a resize's to fewer ranks."""
        return self.world is not None and isinstance(rank, int) and rank >= self.world

    def alive_after(self, alive: set[Key], ranks: Iterable[int]) -> set[Key]:
        """The processes of ``alive`` left once this cell is sent to ``ranks``: those a resize ends gone, the
        newcomers among ``ranks`` (their supervisor starts them first) in."""
        return {key for key in alive if not self.leaves(key)} | (set(self.newcomers) & set(ranks))


def world_variables(world: int, nodes: int = 1) -> dict[str, str]:
    """The variables of a rank's environment that say how many ranks a session has, on how many nodes (as many
    on each): what a resize to ``world`` ranks, or the loss of a node, changes in every rank."""
    sizes = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world // nodes), "ROLE_WORLD_SIZE": str(world)}
    return sizes | {"GROUP_WORLD_SIZE": str(nodes)}


@dataclass(frozen=True)
class Line:
    """A line typed in the notebook for the rank's debugger (None: end of input, and pdb quits)."""

    kind: ClassVar[str] = "line"
    line: str | None


# -- rank → supervisor ----------------------------------------------------------------------------
@dataclass(frozen=True)
class InCell:
    """The rank took its cell: an interrupt for it is no longer held back."""

    kind: ClassVar[str] = "in cell"


@dataclass(frozen=True)
class CellEnd:
    """The rank's cell ended: how (a ``CellEnded`` or ``Failed``, as ``records.encode`` writes it on the
    report pipe), and its names (``results.Packed``'s bytes; None in a rank that sends none). Large names
    come instead in a sealed memory file that travels with the message: ``in_file`` is its size
    (``events.ResultInFile``)."""

    kind: ClassVar[str] = "ended"
    record: bytes
    names: bytes | None
    in_file: int | None = None


@dataclass(frozen=True)
class Pulled:
    """The names a `%taas pull` asked for while the cell runs, taken between two optimizer steps (``number``: the
    pull's); as ``CellEnd``'s names, large ones in a memory file of ``in_file`` bytes."""

    kind: ClassVar[str] = "pulled"
    number: int
    names: bytes | None
    in_file: int | None = None


@dataclass(frozen=True)
class Prompt:
    """The rank's debugger reads a line: the kernel asks the notebook for one, showing ``prompt``."""

    kind: ClassVar[str] = "input"
    prompt: str


ToRank = Union[SessionCell, Line]
FromRank = Union[InCell, CellEnd, Prompt, Pulled]

# Who sends what to whom: docs/architecture.md's table of messages lists exactly these (test_protocol.py).
DIRECTIONS = (("supervisor", "rank", ToRank), ("rank", "supervisor", FromRank))

SupervisorEnd = Channel[ToRank, FromRank]
RankEnd = Channel[FromRank, ToRank]


def supervisor_end(sock: socket.socket, secret: bytes, run_id: str) -> SupervisorEnd:
    return Channel(sock, secret, run_id, receives=FromRank)


def rank_end(sock: socket.socket, secret: bytes, run_id: str) -> RankEnd:
    return Channel(sock, secret, run_id, receives=ToRank)
