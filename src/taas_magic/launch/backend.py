"""What the kernel needs from a backend: a plan per cell, a group of ranks per start (events: wire/events.py).

"Start these ranks with these environments and this task; tell me what they print, what they
report, and when each exits and how." The contract holds no process ids, file descriptors or
shared paths, so a cluster backend (one agent per node) can stand behind it as the local one does.

    Backend[PlanT].prepare(make_task, cell) -> PlanT     once per cell: the task, built once, and what
                                                        the backend's ranks need besides (shipped names)
    Backend[PlanT].start(plan, Launch) -> SessionGroup   once per start of the run (a restart is another
                                                        Launch of the same plan: a fresh run id)
    plan.holding, plan.close()                          what the plan's ranks hold of the notebook;
                                                        what the plan holds in the kernel, let go

Each backend's plan is its own type (``ForkPlan``, ``ForkServerRequest``, ``ClusterPlan``): the
kernel never asks which one it has.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Iterable, Protocol, TypeVar, runtime_checkable

from taas_magic.cell_names import names_read, top_level_bindings
from taas_magic.wire.events import Event, Key
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.task import KernelContext, RankTask

Sources = dict[str, tuple[str, str]]  # the notebook's cells by file name: (label, code), for tracebacks


class RankGroup(Protocol):
    """A started set of ranks; ``close`` leaves nothing behind, whatever state they are in."""

    def events(self, timeout: float) -> list[Event]: ...

    def running(self) -> set[Key]: ...

    def signal(self, signum: int, ranks: Iterable[Key] | None = None) -> None:
        """Send a signal to the ranks (all running ones by default) and everything they started."""

    def stacks(self, ranks: Iterable[Key], timeout: float) -> dict[Key, str]:
        """Each rank's Python stack right now, as text."""

    def nodes(self) -> frozenset[str]:
        """The ids of the cluster nodes the group holds while it runs; none on this machine."""

    def close(self) -> None: ...


class SessionGroup(RankGroup, Protocol):
    """A group whose ranks outlive their first cell: each rank runs the cells it is sent, one after
    another, and reports the end of each (a ``CellEnded`` or ``Failed`` report, rank 0's ``Result``
    before it)."""

    def run_cell(self, cell: SessionCell, ranks: Iterable[int], fds: tuple[int, ...] = ()) -> None:
        """Send ``cell`` to ``ranks``, with the descriptors it needs."""

    def answer(self, rank: Key, line: str | None) -> None:
        """Answer a rank's ``InputRequest``: a line of input, or None when none can be had."""

    def ask_pull(self, number: int, names: tuple[str, ...], ranks: tuple[int, ...]) -> bool:
        """Ask ``ranks`` for ``names`` while their cell runs, each answering between two optimizer steps every rank
        agrees on (``Result.pull``); False where the group cannot."""


@runtime_checkable
class GrowingGroup(Protocol):
    """A session's group whose new ranks are started apart from the cell that makes them join (a cluster's: on the
    nodes its placement holds); where a group has no ``grow``, its supervisor starts them with that cell."""

    def grow(self, world: int, nodes: int) -> None:
        """Start ranks up to ``world``, on ``nodes`` nodes in all, to join with the next cell; a one-line
        ``TaasUsageError``, and nothing started, where they cannot."""


@dataclass(frozen=True)
class Cell:
    """The cell a run comes from, analysed once, as a backend may need it to prepare what it starts."""

    reads: frozenset[str]  # every name its code loads: candidates to take from the notebook
    binds: tuple[str, ...]  # the names it binds at top level, in order
    namespace: dict[str, object]  # the notebook's names
    label: str  # how tracebacks name the cell: "Cell In[5]"
    filename: str  # the file IPython compiled it as, which its code and tracebacks name

    @classmethod
    def of(cls, tree: ast.Module, namespace: dict[str, object], label: str, filename: str) -> "Cell":
        return cls(frozenset(names_read(tree)), tuple(top_level_bindings(tree)), namespace, label, filename)


@dataclass(frozen=True)
class Launch:
    """One start of a run's ranks: its run id, and each rank's environment (torchrun's variables and
    taas's own). A run restarted by ``--max-restarts`` is a new launch of the same plan."""

    run_id: str
    envs: dict[int, dict[str, str]]


class MakeTask(Protocol):
    """The kernel's recipe for the run's ``RankTask``: a backend calls it once, with what its ranks
    need that forked ones inherit (the notebook's cells for tracebacks, the kernel's process state)."""

    def __call__(self, *, sources: Sources, context: KernelContext | None) -> RankTask: ...


@dataclass(frozen=True)
class Holding:
    """What ranks that do not share the kernel's memory were given of the notebook: the names
    shipped to them, and the cells' files they can quote in tracebacks."""

    names: frozenset[str]
    sources: frozenset[str]


class Plan(Protocol):
    """What a backend prepared for one cell."""

    @property
    def holding(self) -> Holding | None:
        """What the ranks will hold of the notebook; None when they are forked from the kernel and
        hold all of it, as it is."""

    def close(self) -> None:
        """Let go of what the plan holds in the kernel (a memory file of shipped tensors), once the
        ranks have it or the run is over."""


PlanT = TypeVar("PlanT", bound=Plan)


class Backend(Protocol[PlanT]):
    name: str  # "fork", "forkserver" or "cluster"

    def prepare(self, make_task: MakeTask, cell: Cell) -> PlanT:
        """What ``start`` takes to run the cell: forked ranks need the task alone; ranks that do not
        share the kernel's memory need what the cell uses packed with it."""

    def start(self, plan: PlanT, launch: Launch) -> SessionGroup:
        """The ranks of ``launch``, running ``plan``'s task; with ``RankTask.keep`` they go on to the
        cells they are sent."""
