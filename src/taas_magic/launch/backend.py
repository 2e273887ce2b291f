"""What the controller needs from a backend, and the events a running group of ranks reports.

"Start these ranks with these environments and this task; tell me what they print, what they
report, and when each exits and how." The contract holds no process ids, file descriptors or
shared paths, so a cluster backend (one agent per node) can stand behind it as the local one does.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from taas_magic.cell_names import names_read, top_level_bindings
from taas_magic.wire.events import Event, Key


class RankGroup(Protocol):
    """A started set of ranks; ``close`` leaves nothing behind, whatever state they are in."""

    def events(self, timeout: float) -> list[Event]: ...

    def running(self) -> set[Key]: ...

    def signal(self, signum: int, ranks: Iterable[Key] | None = None) -> None:
        """Send a signal to the ranks (all running ones by default) and everything they started."""

    def stacks(self, ranks: Iterable[Key], timeout: float) -> dict[Key, str]:
        """Each rank's Python stack right now, as text."""

    def close(self) -> None: ...


class SessionGroup(RankGroup, Protocol):
    """A group whose ranks outlive their first cell: each rank runs the cells it is sent, one after
    another, and reports the end of each (a ``CellEnded`` or ``Failed`` report, rank 0's ``Result``
    before it)."""

    def run_cell(self, cell: Any, ranks: Iterable[int], fds: tuple[int, ...] = ()) -> None:
        """Send ``cell`` (a ``session_rank.SessionCell``) to ``ranks``, with the descriptors it needs."""

    def answer(self, rank: Key, line: str | None) -> None:
        """Answer a rank's ``InputRequest``: a line of input, or None when none can be had."""


@dataclass(frozen=True)
class Cell:
    """The cell a run comes from, analysed once, as a backend may need it to prepare what it starts."""

    reads: frozenset[str]  # every name its code loads: candidates to take from the notebook
    binds: tuple[str, ...]  # the names it binds at top level, in order
    namespace: dict[str, Any]  # the notebook's names
    label: str  # how tracebacks name the cell: "Cell In[5]"

    @classmethod
    def of(cls, tree: ast.Module, namespace: dict[str, Any], label: str) -> "Cell":
        return cls(frozenset(names_read(tree)), tuple(top_level_bindings(tree)), namespace, label)


class Backend(Protocol):
    name: str

    def prepare(self, task: Any, cell: Cell) -> Any:
        """What ``start`` takes to run ``task``: forked ranks need the task alone; ranks that do not
        share the kernel's memory need what the cell uses packed with it."""

    def start(self, envs: dict[int, dict[str, str]], payload: Any) -> RankGroup: ...
