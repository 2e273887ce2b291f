"""Where a run meets the cell it runs for: one object for the cell's output, live view, prompts, pictures and the
names of the notebook's cells, handed from the magic to the pump that uses them.

A run of any kind (a one-shot cell, a session's cell, ``%taas pull`` or ``push``, ``%taas debug``) is given its
own: nothing of one cell's front end stays for the next (a later command drawing into an earlier cell's view).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

from taas_magic.kernel.header.spec import LaunchSpec
from taas_magic.kernel.view.live_view import RunView
from taas_magic.kernel.view.streams import RankOutput
from taas_magic.kernel.view.tidy_output import TidyRankOutput
from taas_magic.wire.events import Key

Write = Callable[[str, str], object]  # (stream, text): where the ranks' output and taas's notices go
Status = Callable[[dict[str, str], bool], object]  # shows the live view: (MIME bundle, final)
Show = Callable[[dict[str, str]], object]  # shows a MIME bundle once, in a display of its own
ReadLine = Callable[[str], str]  # asks the user for a line of input: the kernel's `input`


class Pulls(Protocol):
    """`%taas pull` asked while a session's cell runs in the background, carried by the run's pump."""

    def take(self) -> tuple[int, tuple[str, ...], tuple[int, ...]] | None:
        """The next pull to ask the ranks for: its number, the names, the ranks that answer."""

    def answered(self, number: int, rank: Key, data: Any) -> None:
        """A rank's names for pull ``number`` (``results.loads`` reads them)."""

    def refused(self, number: int) -> None:
        """The ranks cannot be asked (the group has no store here): the pull gets nothing."""


class Errand(Protocol):
    """Work asked of the run's group while its cell runs in the background (``%taas stacks``), done by its pump."""

    def run(self, group: Any) -> None: ...


class Errands(Protocol):
    def take(self) -> Errand | None:
        """The next errand to do with the run's group, if one was asked."""


@dataclass(frozen=True)
class CellFrontEnd:
    """``write``: the cell's streams. ``cell_names``: code file name -> "Cell In[5]", for stacks and tracebacks.
    ``status``: the live view's display, redrawn in place (None: no view, the ranks' output as they write it).
    ``read_line``: a line a rank's debugger waits for (``breakpoint()``; None: the rank is told there is none).
    ``picture``: shows where the ranks' time went under the summary (``--profile``). ``stopped``: the ranks
    stopped in the notebook's visual debugger now (a person's time, as at a pdb prompt). ``stop_asked``: whether
    a stop was asked from outside the cell since last asked (a background run's), taken as an interrupt.
    ``pulls``: the names the notebook pulls while the cell runs in the background; ``errands``: what else it asks of
    the run's group meanwhile (``%taas stacks``)."""

    write: Write
    cell_names: Mapping[str, str] = field(default_factory=dict)
    status: Status | None = None
    read_line: ReadLine | None = None
    picture: Show | None = None
    stopped: Callable[[], frozenset[int]] = frozenset
    stop_asked: Callable[[], bool] = bool  # bool(): never
    pulls: Pulls | None = None  # a background session cell's: names pulled while it runs
    errands: Errands | None = None  # a background session cell's: `%taas stacks` while it runs

    def output(
        self, spec: LaunchSpec, ranks: list[int], labels: Mapping[Key, str] | None = None
    ) -> tuple[RankOutput, RunView | None]:
        """Where the ranks' output goes: with a live view, tidied, bars into the view's rows."""
        shown = None if spec.output == "all" else {0}
        if self.status is None:
            return RankOutput(self.write, prefix=spec.show_rank_prefix, shown=shown, labels=labels), None
        view = RunView(
            f"{len(ranks)} rank{'s' * (len(ranks) != 1)} on {spec.device}",
            ranks,
            spec.ranks_per_node if spec.nodes > 1 else 0,
        )
        return TidyRankOutput(self.write, spec.show_rank_prefix, len(ranks), view.bar, shown, labels), view


class ViewDisplay:
    """A run's live view: one display in the cell, updated in place, left as the run's summary.

    A terminal cannot redraw a display: there (``live`` False) only the summary is shown. The display goes
    through the kernel's publisher as the cell had it when the run began: a run in the background goes on
    drawing into its own cell while another cell has put its own publisher in place (``%%capture``).
    """

    def __init__(self, live: bool) -> None:
        self.live = live
        self.publisher = _display_publisher()
        self.display_id: str | None = None  # once shown

    def show(self, bundle: dict[str, str], final: bool) -> None:
        if not self.live and not final:
            return
        first = self.display_id is None
        if self.display_id is None:
            self.display_id = uuid.uuid4().hex
        self.publisher.publish(data=bundle, metadata={}, transient={"display_id": self.display_id}, update=not first)


def picture_in_this_cell() -> Show:
    """What shows a MIME bundle once, in a display of its own, in the cell running now (the picture under a
    ``--profile`` run's summary, drawn when the run ends, whatever cell runs then)."""
    publisher = _display_publisher()

    def show(bundle: dict[str, str]) -> None:
        publisher.publish(data=bundle, metadata={})

    return show


def _display_publisher() -> Any:
    """The kernel's display publisher, as the cell running now has it (outside IPython, one that prints)."""
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.getipython import get_ipython

    shell = get_ipython()
    return shell.display_pub if shell is not None else DisplayPublisher()
