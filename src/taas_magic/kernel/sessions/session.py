"""Sessions, in the kernel: ranks that stay alive from cell to cell (`--keep`), and the cells run in them.

A session is the group of a run started with ``RankTask.keep``: its ranks run its first cell,
then each cell they are sent (``rank/session.py``). A cell in a session ends when every rank
it runs in has said so, not when they exit. Its outcomes:

- the cell's code raised in a rank: the cell fails with that traceback, the ranks still in the
  cell are interrupted (as a failing one-shot run stops them), and the session goes on; those that
  waited for it in a collective are released as it cuts its process group's connections, and every
  rank then connects the group anew (``rank/group_links.py``), so that the next cell's collectives
  and DDP work;
- an interrupt or ``--timeout``: KeyboardInterrupt in the cell's code in every rank, before the same
  optimizer step where they train (``rank/stopping.py``); the session goes on;
- a rank that dies, in a cell or between cells (on CPU: ``heals``): the cell fails with its death, a new
  process takes its place (on its own node, on a cluster), given what the other ranks hold alike
  (``rank/healing.py``) and the dead rank's share of each served loader (``StandIn.take_over``), and the
  session goes on; a cluster session's ranks lost with their node are left out (``go_on_without``);
- a rank that does not come back from an interrupt within 5 s, a cell that calls ``sys.exit()``, a death
  that cannot be healed: the session ends. Everything of it is closed, and the cell says why.

The notebook's names a cell reads are sent only when they changed since the ranks last had them
(``shipping.fingerprint``); the ranks' own names stay theirs.
"""

from __future__ import annotations

import dataclasses
import linecache
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from taas_magic.cell_names import names_reached
from taas_magic.delivery.service import producer_labels
from taas_magic.errors import SessionEnded, TaasRunError
from taas_magic.kernel.header.spec import LaunchSpec, without_last_nodes
from taas_magic.kernel.run.run_result import SESSION, RunResult
from taas_magic.kernel.running.background import BackgroundRun
from taas_magic.kernel.running.controller import LOST, watch
from taas_magic.kernel.sessions import reloading, session_stacks
from taas_magic.kernel.view import render, streams
from taas_magic.kernel.view.front_end import CellFrontEnd, ReadLine
from taas_magic.kernel.view.streams import RankOutput
from taas_magic.launch.backend import Cell, SessionGroup
from taas_magic.per_rank import span
from taas_magic.process import cell_files, containment
from taas_magic.wire import shipping
from taas_magic.wire.events import NODE_LOST, Exited, Key, Output, Producer
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.records import Failed
from taas_magic.wire.task import CellOrder, LoaderPlan

IDLE_SECONDS = 3600.0  # the default --idle: a forgotten session gives its GPUs back after an hour
REGROUP_SECONDS = 60.0  # every rank is between cells: connecting the group anew takes milliseconds
INTERRUPT_WAITED = "taas: the interrupt came as the ranks connected their process group anew: it waited until they had"


@dataclass
class Session:
    """A live session: its ranks, what they were started with, and what they hold of the notebook."""

    group: SessionGroup
    spec: LaunchSpec
    start: str  # "fork", "forkserver" or "cluster"
    known: dict[str, shipping.Fingerprint]  # notebook name -> fingerprint of the value the ranks were given
    sources_sent: set[str]  # the notebook's cells the ranks can quote in tracebacks
    started: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    cells: int = 0
    sent: int = 0  # cells sent to the ranks, the one that started the session not counted: the next one's number
    failed: list[int] = field(default_factory=list)  # ranks whose last cell raised, the first to fail first
    ended: str = ""  # why the session is over, once it is
    reloads: reloading.KernelReloads = field(default_factory=lambda: reloading.KernelReloads(_shell()))
    served: dict[str, "weakref.ref[Any]"] = field(default_factory=dict)  # notebook name -> loader its producers serve
    loaders: int = 0  # how many loaders the session's producers serve (the next one's number)
    plans: dict[str, LoaderPlan] = field(default_factory=dict)  # how each name the producers serve is served
    labels: dict[Key, str] = field(default_factory=dict)  # the producers' names: "producer 0 of train_loader"
    # Ranks that died between cells, with how they ended: replaced (or left out, lost with their node) as the next
    # cell begins.
    dead: dict[int, int] = field(default_factory=dict)
    busy: BackgroundRun | None = None  # the run in the background whose cell the ranks run, if any

    def running_in_background(self) -> BackgroundRun | None:
        """The run in the background whose cell runs in the session now: nothing else may use the session (its
        events are that run's to read) until it ends."""
        return self.busy if self.busy is not None and not self.busy.done() else None

    @property
    def size(self) -> int:
        return self.spec.world_size

    def serve(self, plans: tuple[LoaderPlan, ...], namespace: Mapping[str, Any]) -> int:
        """The session's producers serve these registered loaders from now on, as the notebook names them;
        returns the number of the first among the session's loaders (producers are keyed by it)."""
        self.served.update({plan.name: weakref.ref(namespace[plan.name]) for plan in plans})
        self.plans.update({plan.name: plan for plan in plans})
        return self._number(plans)

    def _number(self, plans: tuple[LoaderPlan, ...]) -> int:
        """Number ``plans`` after the session's other loaders and label their producers; returns the first number."""
        first = self.loaders
        self.loaders += len(plans)
        self.labels.update(producer_labels(plans, first))
        return first

    def resend(self, names: list[str]) -> None:
        """The next cell sends these names even if the ranks hold them as the notebook does."""
        for name in names:
            self.known.pop(name, None)

    def serves(self, name: str, value: Any) -> bool:
        """Whether the session's producers serve ``value`` under ``name``: the ranks hold its stand-in."""
        loader = self.served.get(name)
        return loader is not None and loader() is value

    # -- cells ----------------------------------------------------------------------------------
    def prepare(
        self, analysed: Cell, order: CellOrder, command: str = ""
    ) -> tuple[SessionCell, shipping.Shipment | None, dict[str, shipping.Fingerprint]]:
        """The cell for the ranks: its order, and the notebook's names it reads that changed; and
        the fingerprints of what it sends, for ``shipped`` once the ranks have it. The order's loaders
        (registered since the session started) are served from this cell on: the supervisor starts their
        producers as it passes the cell on, and the ranks make their stand-ins. ``command``: the line that
        sends the names (``%taas push``) when no cell does."""
        namespace = analysed.namespace
        self._forget_rebound(namespace)
        prints = _Fingerprints(namespace)  # each name's, once for this cell
        # What the cell reads, and what the notebook's functions it calls read: a name changed in
        # the notebook matters wherever it is read from.
        needed = shipping.needed_names(names_reached(analysed.reads, namespace), namespace)
        changed = [name for name in needed if self.known.get(name) != prints(name)]
        shipment = None
        if changed:
            shipment = shipping.pack_for_session(
                namespace,
                changed,
                lambda name, value: name in self.known and self.known[name] == prints(name),
                command,
            )
        assert order.code is not None
        sources = self._new_sources(order.code.co_filename, analysed.label)
        first_loader = self.serve(order.loaders, namespace) if order.loaders else 0
        self.sent += 1
        cell = SessionCell(
            order,
            shipment.data if shipment else b"",
            shipment.tensors_size if shipment else 0,
            sources,
            first_loader=first_loader,
            number=self.sent,
        )
        sent = {name: prints(name) for name in (shipment.sent if shipment else ()) if name in namespace}
        return cell, shipment, sent

    def _forget_rebound(self, namespace: Mapping[str, Any]) -> None:
        """Drop what the kernel holds of values the notebook let go of (a list, a dict: they take
        no weak reference): such a name is sent again when a cell reads it."""
        for name, known in list(self.known.items()):
            if known.keeps_other_than(namespace.get(name, _UNBOUND)):
                del self.known[name]

    def shipped(self, sent: Mapping[str, shipping.Fingerprint]) -> None:
        """The ranks now hold these names as the notebook has them (``prepare`` says which)."""
        self.known.update(sent)

    def took_back(self, values: Mapping[str, Any]) -> None:
        """The ranks' names joined the notebook (one rank's, or a ``taas.PerRank``): every rank holds its
        own value of each already, so they are not sent back to the ranks unless the notebook changes them."""
        for name, value in values.items():
            self.known[name] = shipping.fingerprint(value)

    def _new_sources(self, filename: str, label: str) -> dict[str, tuple[str, str]]:
        files = cell_files.cell_labels(_shell())
        files[filename] = label
        sources = {
            name: (files[name], "".join(linecache.getlines(name))) for name in files if name not in self.sources_sent
        }
        self.sources_sent.update(sources)
        return sources

    def run(
        self,
        cell: SessionCell,
        shipment: shipping.Shipment | None,
        ranks: list[int],
        spec: LaunchSpec,
        front: CellFrontEnd,
        notebook_cell: bool = True,
    ) -> RunResult:
        """Run ``cell`` in ``ranks`` for the cell ``front`` stands for; the sending ranks' pickled names on
        success, else raise what the cell shows. ``notebook_cell`` False: ``%taas pull`` or ``push``, which is
        not counted as a cell and leaves the ranks to debug as they were."""
        fds = (shipment.tensors_fd,) if shipment is not None and shipment.tensors_fd is not None else ()
        cell = dataclasses.replace(cell, reload=self.reloads.for_cell(_shell(), ranks))
        return self._cell(lambda: self.group.run_cell(cell, ranks, fds), ranks, spec, front, notebook_cell)

    def first_cell(self, spec: LaunchSpec, front: CellFrontEnd) -> RunResult:
        """The cell that started the session, which every rank runs as it starts."""
        return self._cell(lambda: None, list(range(self.size)), spec, front)

    def debug(self, rank: int, write: Callable[[str, str], object], read_line: ReadLine) -> None:
        """The post-mortem debugger in ``rank`` at its last cell's error, typed into from the notebook: every
        line of it in the cell's output, no view."""
        spec = dataclasses.replace(self.spec, output="all", timeout=None)
        front = CellFrontEnd(write, read_line=read_line)
        result = self._watch(lambda: self.group.run_cell(SessionCell.post_mortem(), [rank], ()), [rank], spec, front)
        error = render.error(result, {})
        if error is not None:
            raise error

    def _cell(
        self,
        send: Callable[[], None],
        ranks: list[int],
        spec: LaunchSpec,
        front: CellFrontEnd,
        notebook_cell: bool = True,
    ) -> RunResult:
        """A cell of the notebook's in ``ranks``: the ranks it fails in are the ones to debug next."""
        self.replace_the_dead(front)
        if notebook_cell:
            self.cells += 1
            self.failed = []
        try:
            result = self._watch(send, ranks, spec, front)
        except SessionEnded as e:
            if notebook_cell:
                self.failed = list(e.failed)  # for `%taas debug` to name: their errors went with the session
            raise
        if notebook_cell:  # a rank that died has no error to debug: a new process is in its place
            self.failed = [rank for rank in _failed_ranks(result) if rank not in result.exits]
        died = tuple(sorted(key for key in result.exits if isinstance(key, int)))
        if len(died) == self.size:  # no rank to heal them from
            self._end(f"every rank died ({render.summary(result.failures[0])})")
            raise render.session_over(self.ended)
        lost = tuple(rank for rank in died if result.exits[rank] == NODE_LOST)
        if lost:
            self.go_on_without(front, lost)
            died = tuple(rank for rank in died if rank < self.size and rank not in lost)  # and then any other death
        if died or (not lost and any(isinstance(r, Failed) and r.left_group for r in result.records.values())):
            self.regroup(front, died)
        for line in render.notices(result):
            front.write("stderr", line + "\n")
        error = render.error(result, front.cell_names)
        if error is not None:
            raise error
        return result

    def heals(self) -> bool:
        """Whether a rank that dies is replaced (``rank/healing.py``): on CPU (gloo: its peers leave their
        collectives as its connections close). The supervisor of its ranks (this machine's, or its node's) keeps
        its end of each served loader's channel for the new process to take over its share."""
        return self.spec.device == "cpu" and self.size > 1

    # -- its process group, its size --------------------------------------------------------------
    def regroup(self, front: CellFrontEnd, died: tuple[int, ...] = (), resized_from: int = 0) -> None:
        """A rank left the process group as the cell failed, or died, or the session was resized (from
        ``resized_from`` ranks): every rank connects it anew, a new process in place of each that died and for each
        new rank, given what the others hold alike; so that the next cell's collectives work, DDP's too. A group
        that cannot be connected again ends the session."""
        self.sent += 1
        cell = SessionCell.reconnect(self.sent, died)
        if resized_from:
            # Served loaders go on at their next pass, planned for the new size by new producers.
            replanned = tuple(self.plans.values()) if self.start != "cluster" else ()
            first = self._number(replanned) if replanned else 0
            cell = SessionCell.resize(self.sent, self.size, resized_from, self.spec.nodes, replanned, first)
        ranks = list(range(self.size))
        if cell.newcomers:  # the new processes know no cell's source, for tracebacks: every one goes with the next cell
            self.sources_sent.clear()
        spec = dataclasses.replace(self.spec, output="all", timeout=REGROUP_SECONDS, hang_after=0)
        with containment.HeldInterrupts() as held:  # cut short, it would leave ranks in and out of the group
            result = self._watch(lambda: self.group.run_cell(cell, ranks, ()), ranks, spec, CellFrontEnd(front.write))
            interrupted, held.came = held.came, False
        if interrupted:
            front.write("stderr", INTERRUPT_WAITED + "\n")
        if result.failures or result.exits:
            failure = result.failures[0] if result.failures else None
            self._end(
                "its process group could not be connected again "
                + (f"as it was resized to {self.size} ranks" if resized_from else "after the cell failed")
                + (f": {render.name(result, failure.rank)}: {render.summary(failure)}" if failure else "")
            )

    def go_on_without(self, front: CellFrontEnd, lost: tuple[int, ...]) -> None:
        """A cluster session's last node was lost (its ranks exited ``NODE_LOST``): it goes on with the other nodes'
        ranks, as a resize to fewer does. A lost node whose ranks are not the last ends it: ranks keep their numbers."""
        world, old = self.size - len(lost), self.size
        if lost != tuple(range(world, old)):
            self._end(f"{span(lost)} were lost with their node, and a session goes on only without its last nodes")
            raise render.session_over(self.ended)
        self.spec, self.failed = without_last_nodes(self.spec, world), [rank for rank in self.failed if rank < world]
        self.regroup(front, resized_from=old)
        if self.ended:
            raise render.session_over(self.ended)

    def _watch(
        self,
        send: Callable[[], None],
        ranks: list[int],
        spec: LaunchSpec,
        front: CellFrontEnd,
    ) -> RunResult:
        """Send to ``ranks`` and watch until each has ended; a session that cannot go on is ended here."""
        if self.ended:
            raise render.session_over(self.ended)
        deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
        watched = watch(
            SESSION, spec, front, self.labels, ranks, deadline=deadline, world=self.size, heals=self.heals()
        )
        state, out = watched.state, watched.output
        pump = watched.pump(self.group)
        lost = False
        try:
            pump.send_whole(send)
            pump.until_over()
        except BaseException as e:
            lost = isinstance(e, LOST)
            self._end(e.why if isinstance(e, SessionEnded) else f"{type(e).__name__}: {e}")
            raise
        finally:
            out.finish()
            pump.show_summary(lost)  # whatever ended the cell: no view is left saying "running"
            self.last_used = time.monotonic()
        return state.result()

    # -- where its processes are ------------------------------------------------------------------
    def where(self, cell_names: Mapping[str, str]) -> list[str]:
        """``%taas stacks`` (``session_stacks.py``): between cells, or while a cell runs in the background, where the
        run's pump takes the stacks (it alone reads the ranks' events then); at the cell's end if it ended first."""
        running = self.running_in_background()
        if running is not None:
            errand = running.errands.ask(lambda group: session_stacks.where(group, self.labels, self.spec, cell_names))
            if errand.wait():
                return list(errand.value)
            running.wait()
        if self.check():
            return [f"taas: the session ended: {self.ended}"]
        return session_stacks.where(self.group, self.labels, self.spec, cell_names)

    # -- its end --------------------------------------------------------------------------------
    def check(self) -> str:
        """Why the session ended on its own since the last cell (idle limit, a rank died), or ''.

        Between cells nothing reads its events; what a rank printed meanwhile is shown here.
        """
        if self.ended:
            return self.ended
        out = RankOutput(streams.write_to_cell, prefix=self.spec.show_rank_prefix, labels=self.labels)
        try:
            for event in self.group.events(0):
                if isinstance(event, Output):
                    out.feed(event.rank, event.stream, event.data)
                elif isinstance(event, Exited) and isinstance(event.rank, Producer) and event.returncode == 0:
                    pass  # its share of a stream cut by --units is built and sent
                elif isinstance(event, Exited) and isinstance(event.rank, int) and self._goes_on_after(event):
                    self._died_between_cells(event)
                elif isinstance(event, Exited):
                    who = self.labels.get(event.rank, f"rank {event.rank}")
                    self._end(render.exited_between_cells(who, event.returncode))
        except TaasRunError as e:
            self._end(getattr(e, "detail", str(e)))
        finally:
            out.finish()
        return self.ended

    def _goes_on_after(self, death: Exited) -> bool:
        return self.heals() or death.returncode == NODE_LOST  # replaced, or left out as its node was lost

    def _died_between_cells(self, death: Exited) -> None:
        """A rank that died while no cell ran (killed, out of memory) is replaced as the next cell begins
        (``replace_the_dead``); the session ends only when no rank is left to heal it from."""
        assert isinstance(death.rank, int)
        self.dead[death.rank] = death.returncode
        self.failed = [rank for rank in self.failed if rank != death.rank]  # its error went with it
        how = render.exited_between_cells(f"rank {death.rank}", death.returncode)
        if len(self.dead) == self.size:
            self._end(f"every rank died between cells ({how})")
            return
        then = "it goes on without it" if death.returncode == NODE_LOST else "a new process takes its place"
        streams.write_to_cell("stderr", f"taas: {how}: {then} as the next taas cell begins\n")

    def replace_the_dead(self, front: CellFrontEnd) -> None:
        """Before a cell: a new process in place of each rank that died between cells, given what the others
        hold alike."""
        if self.dead and not self.ended:
            dead, self.dead = self.dead, {}
            lost = tuple(sorted(rank for rank, code in dead.items() if code == NODE_LOST))
            if lost:
                self.go_on_without(front, lost)
            died = tuple(sorted(rank for rank in dead if rank not in lost and rank < self.size))
            if died and not self.ended:
                self.regroup(front, died)
            if self.ended:
                raise render.session_over(self.ended)

    def stop(self, why: str = "stopped with %taas stop") -> None:
        self._end(why)

    def _end(self, why: str) -> None:
        if not self.ended:
            self.ended = why
            containment.close_whole(self.group.close)

    def describe(self) -> str:
        busy = self.running_in_background()
        if busy is not None:
            return (
                f"up: {self.size} rank{'s' * (self.size != 1)} on {self.spec.device}, running cell {busy.cell} in the "
                f"background (run {busy.number}; %taas wait waits for it, %taas stop stops it)"
            )
        if self.check():
            return f"ended: {self.ended}"
        idle = time.monotonic() - self.last_used
        configuration = f", configuration {self.spec.configuration.name}" if self.spec.configuration else ""
        nodes = f"{self.spec.nodes} node{'s' * (self.spec.nodes != 1)}"
        where = f"on {nodes} of the cluster" if self.start == "cluster" else f"started by {self.start}"
        return (
            f"up: {self.size} rank{'s' * (self.size != 1)} on {self.spec.device}{configuration}, "
            f"{where}, {self.cells} cell{'s' * (self.cells != 1)} run, idle for {idle:.0f} s "
            f"(ends after {self.spec.idle_limit:g} s idle; %taas stop ends it now)"
        )


def _failed_ranks(result: RunResult) -> list[int]:
    return [failure.rank for failure in result.failures if isinstance(failure.rank, int)]


def _shell() -> Any:
    """The kernel's IPython shell (None outside IPython)."""
    from IPython import get_ipython

    return get_ipython()


class _Fingerprints:
    """The notebook's names' fingerprints, each taken once: a cell's check, its pickling and its
    bookkeeping ask for the same names."""

    def __init__(self, namespace: Mapping[str, Any]):
        self.namespace = namespace
        self.taken: dict[str, shipping.Fingerprint] = {}

    def __call__(self, name: str) -> shipping.Fingerprint:
        if name not in self.taken:
            self.taken[name] = shipping.fingerprint(self.namespace[name])
        return self.taken[name]


_UNBOUND = object()  # what a name the notebook deleted is bound to, for _forget_rebound
