"""Sessions, in the kernel: ranks that stay alive from cell to cell (`--keep`), and the cells run in them.

A session is the group of a run started with ``RankTask.keep``: its ranks run its first cell,
then each cell they are sent (``session_rank.py``). A cell in a session ends when every rank
it runs in has said so, not when they exit. Its outcomes:

- the cell's code raised in a rank: the cell fails with that traceback, the ranks still in the
  cell are interrupted (as a failing one-shot run stops them), and the session goes on;
- an interrupt or ``--timeout``: KeyboardInterrupt in the cell's code in every rank; the session
  goes on;
- a rank that does not come back from an interrupt within 5 s, or a rank that exits or dies,
  ends the session: its process group cannot continue. Everything of it is closed, and the
  cell says why.

The notebook's names a cell reads are sent only when they changed since the ranks last had them
(``shipping.fingerprint``); the ranks' own names stay theirs.
"""

from __future__ import annotations

import dataclasses
import linecache
import signal
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from taas_magic.process import containment
from taas_magic.kernel import reloading
from taas_magic.wire import shipping
from taas_magic.kernel import streams
from taas_magic.launch.backend import Cell, SessionGroup
from taas_magic.wire.events import Event, Exited, Key, Output, Producer, key_order
from taas_magic.cell_names import names_reached
from taas_magic.kernel.controller import (
    BOLD,
    RED,
    RESET,
    Failure,
    Outcome,
    RunInterrupted,
    _describe_exit,
    _Watch,
    live_output,
    plain,
    user_stack,
)
from taas_magic.delivery.service import LoaderPlan, producer_labels
from taas_magic.kernel.live_view import RunView
from taas_magic.errors import RankFailed, RunTimedOut, TaasRunError
from taas_magic.wire.records import CellEnded, Failed
from taas_magic.rank.session import SessionCell
from taas_magic.kernel.spec import LaunchSpec
from taas_magic.kernel.streams import RankOutput

RETURN_SECONDS = 5.0  # how long ranks may take to leave an interrupted cell before the session ends
STACK_SECONDS = 2.0
IDLE_SECONDS = 3600.0  # the default --idle: a forgotten session gives its GPUs back after an hour


class SessionEnded(TaasRunError):
    """The session is over (a rank died, or did not leave an interrupted cell): nothing of it is left."""


ReadLine = Callable[[str], str]  # asks the user for a line of input: the kernel's `input`


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
    failed: list[int] = field(default_factory=list)  # ranks whose last cell raised, the first to fail first
    ended: str = ""  # why the session is over, once it is
    status: Callable[[dict[str, str], bool], object] | None = None  # shows the cell's live view (None: no view)
    reloads: reloading.KernelReloads = field(default_factory=lambda: reloading.KernelReloads(_shell()))
    served: dict[str, "weakref.ref[Any]"] = field(default_factory=dict)  # notebook name -> loader its producers serve
    loaders: int = 0  # how many loaders the session's producers serve (the next one's number)
    labels: dict[Key, str] = field(default_factory=dict)  # the producers' names: "producer 0 of train_loader"

    @property
    def size(self) -> int:
        return self.spec.world_size

    def serve(self, plans: tuple[LoaderPlan, ...], namespace: Mapping[str, Any]) -> int:
        """The session's producers serve these registered loaders from now on, as the notebook names them;
        returns the number of the first among the session's loaders (producers are keyed by it)."""
        first = self.loaders
        self.loaders += len(plans)
        self.served.update({plan.name: weakref.ref(namespace[plan.name]) for plan in plans})
        self.labels.update(producer_labels(plans, first))
        return first

    def begin_serving(self, cell: SessionCell, plans: tuple[LoaderPlan, ...], namespace: Mapping[str, Any]
                      ) -> SessionCell:
        """``cell`` with the loaders registered since the session started that it uses: the supervisor
        starts their producers as it passes the cell on, and the ranks make their stand-ins."""
        if not plans:
            return cell
        return dataclasses.replace(cell, loaders=plans, first_loader=self.serve(plans, namespace))

    def resend(self, names: list[str]) -> None:
        """The next cell sends these names even if the ranks hold them as the notebook does."""
        for name in names:
            self.known.pop(name, None)

    def serves(self, name: str, value: Any) -> bool:
        """Whether the session's producers serve ``value`` under ``name``: the ranks hold its stand-in."""
        loader = self.served.get(name)
        return loader is not None and loader() is value

    # -- cells ----------------------------------------------------------------------------------
    def prepare(self, analysed: Cell, code: Any, return_names: tuple[str, ...]
                ) -> tuple[SessionCell, shipping.Shipment | None, dict[str, shipping.Fingerprint]]:
        """The cell for the ranks: its code, and the notebook's names it reads that changed; and
        the fingerprints of what it sends, for ``shipped`` once the ranks have it."""
        namespace = analysed.namespace
        self._forget_rebound(namespace)
        prints = _Fingerprints(namespace)  # each name's, once for this cell
        # What the cell reads, and what the notebook's functions it calls read: a name changed in
        # the notebook matters wherever it is read from.
        needed = shipping.needed_names(names_reached(analysed.reads, namespace), namespace)
        changed = [name for name in needed if self.known.get(name) != prints(name)]
        shipment = None
        if changed:
            shipment = shipping.pack_for_session(namespace, changed,
                                                 lambda name, value: name in self.known and self.known[name] == prints(name))
        sources = self._new_sources(code.co_filename, analysed.label)
        cell = SessionCell(code, return_names, shipment.data if shipment else b"",
                           shipment.tensors_size if shipment else 0, sources)
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
        """Rank 0's names joined the notebook: every rank holds its own value of each already, so
        they are not sent back to the ranks unless the notebook changes them."""
        for name, value in values.items():
            self.known[name] = shipping.fingerprint(value)

    def _new_sources(self, filename: str, label: str) -> dict[str, tuple[str, str]]:
        known = getattr(getattr(_shell(), "compile", None), "_filename_map", {})
        files = {name: f"Cell In[{number}]" for name, number in known.items()}
        files[filename] = label
        sources = {name: (files[name], "".join(linecache.getlines(name))) for name in files
                   if name not in self.sources_sent}
        self.sources_sent.update(sources)
        return sources

    def run(self, cell: SessionCell, shipment: shipping.Shipment | None, ranks: list[int], spec: LaunchSpec,
            write: Callable[[str, str], object], cell_names: Mapping[str, str], read_line: ReadLine) -> Outcome:
        """Run ``cell`` in ``ranks``; rank 0's pickled names on success, else raise what the cell shows."""
        fds = (shipment.tensors_fd,) if shipment is not None and shipment.tensors_fd is not None else ()
        cell = dataclasses.replace(cell, reload=self.reloads.for_cell(_shell(), ranks))
        return self._cell(lambda: self.group.run_cell(cell, ranks, fds), ranks, spec, write, cell_names, read_line)

    def first_cell(self, spec: LaunchSpec, write: Callable[[str, str], object], cell_names: Mapping[str, str],
                   read_line: ReadLine) -> Outcome:
        """The cell that started the session, which every rank runs as it starts."""
        return self._cell(lambda: None, list(range(self.size)), spec, write, cell_names, read_line)

    def debug(self, rank: int, write: Callable[[str, str], object], read_line: ReadLine) -> None:
        """The post-mortem debugger in ``rank`` at its last cell's error, typed into from the notebook."""
        spec = dataclasses.replace(self.spec, output="all", timeout=None)
        self._watch(lambda: self.group.run_cell(SessionCell(None), [rank], ()), [rank], spec, write, {},
                    read_line).raise_outcome()

    def _cell(self, send: Callable[[], None], ranks: list[int], spec: LaunchSpec,
              write: Callable[[str, str], object], cell_names: Mapping[str, str], read_line: ReadLine) -> Outcome:
        """A cell of the notebook's in ``ranks``: the ranks it fails in are the ones to debug next."""
        self.cells += 1
        self.failed = []
        watch = self._watch(send, ranks, spec, write, cell_names, read_line)
        self.failed = [failure.rank for failure in watch.failures() if isinstance(failure.rank, int)]
        for line in watch.delivery_summaries():
            write("stderr", line + "\n")
        watch.raise_outcome()
        return Outcome(watch.results, watch.skipped_names())

    def _watch(self, send: Callable[[], None], ranks: list[int], spec: LaunchSpec,
               write: Callable[[str, str], object], cell_names: Mapping[str, str],
               read_line: ReadLine) -> "_CellWatch":
        """Send to ``ranks`` and watch until each has ended; a session that cannot go on is ended here."""
        if self.ended:
            raise SessionEnded(f"the session ended: {self.ended}", [f"taas: the session ended: {self.ended}"])
        out, view = live_output(spec, write, ranks, self.status, self.labels)
        watch = _CellWatch(spec, out, cell_names, self.group, ranks, read_line, write, view, self.status, self.labels)
        try:
            watch.until_ended(send)
            watch.show_view(final=True)
        except BaseException as e:
            self._end(str(e) if isinstance(e, SessionEnded) else f"{type(e).__name__}: {e}")
            raise
        finally:
            out.finish()
            self.last_used = time.monotonic()
        return watch

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
                elif isinstance(event, Exited):
                    who = self.labels.get(event.rank, f"rank {event.rank}")
                    self._end(f"{who} {_describe_exit(event.returncode) if event.returncode else 'exited'} "
                              "between cells")
        except TaasRunError as e:
            self._end(getattr(e, "detail", str(e)))
        finally:
            out.finish()
        return self.ended

    def stop(self, why: str = "stopped with %taas stop") -> None:
        self._end(why)

    def _end(self, why: str) -> None:
        if not self.ended:
            self.ended = why
            self.group.close()

    def describe(self) -> str:
        if self.check():
            return f"ended: {self.ended}"
        idle = time.monotonic() - self.last_used
        configuration = f", configuration {self.spec.configuration.name}" if self.spec.configuration else ""
        where = "on the cluster" if self.start == "cluster" else f"started by {self.start}"
        return (f"up: {self.size} rank{'s' * (self.size != 1)} on {self.spec.device}{configuration}, "
                f"{where}, {self.cells} cell{'s' * (self.cells != 1)} run, idle for {idle:.0f} s "
                f"(ends after {self.spec.idle_limit:g} s idle; %taas stop ends it now)")


class _CellWatch(_Watch):
    """Watches one cell in a session: until each of its ranks has said how the cell ended there."""

    def __init__(self, spec: LaunchSpec, output: RankOutput, cell_names: Mapping[str, str],
                 group: SessionGroup, ranks: list[int], read_line: ReadLine, write: Callable[[str, str], object],
                 view: RunView | None = None, status: Callable[[dict[str, str], bool], object] | None = None,
                 labels: Mapping[Key, str] | None = None):
        super().__init__(spec, output, cell_names, dict(labels or {}), write, read_line, view, status)
        self.group: SessionGroup = group
        self.ranks = set(ranks)
        self.deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
        self.interrupt_sent: float | None = None
        self.backlog: list[Event] = []  # events received and not taken yet

    def _exiting(self) -> bool:
        """A rank's cell called sys.exit(): the rank is ending (its exit ends the session)."""
        return any(isinstance(record, CellEnded) and record.exited for record in self.records.values())

    def _producer_failed(self) -> bool:
        """A producer reported its failure: its exit, which ends the session, follows."""
        return any(isinstance(key, Producer) and isinstance(record, Failed) for key, record in self.records.items())

    def _ended(self) -> dict[Key, tuple[int, float]]:
        """Ranks whose cell ended: they stay, so their status is 0."""
        return {rank: (0, self.started) for rank in self.records}

    def in_cell(self) -> set[Key]:
        return {rank for rank in self.ranks if rank not in self.records}

    def until_ended(self, send: Callable[[], None] = lambda: None) -> None:
        """Send the cell (``send``), then watch it until every rank of it has said how it ended there."""
        try:
            _uninterrupted(send)
        except KeyboardInterrupt:
            self.interrupted = True
            self._interrupt()
        while self.in_cell() or self._exiting() or self._producer_failed():
            try:
                self._cell_step()
            except KeyboardInterrupt:
                self.interrupted = True
                if self.interrupt_sent is not None:  # impatient: the session ends now
                    raise SessionEnded(*_ended_message("interrupted twice while its ranks were leaving the cell"))
                self._interrupt()

    def _cell_step(self) -> None:
        self._take_events(0.05)
        self.output.flush_idle()
        self.show_view()
        now = time.monotonic()
        if self.interrupt_sent is None and self._failed():
            self._interrupt()  # a rank failed: the others may wait for it forever in a collective
        elif self.interrupt_sent is None and self.quit:
            self.interrupted = True  # quitting the debugger is the user interrupting the cell
            self._interrupt()
        elif self.interrupt_sent is None and self.deadline is not None and now >= self.deadline:
            self._time_out_cell()
        elif self.interrupt_sent is not None and now - self.interrupt_sent > RETURN_SECONDS and self.in_cell():
            stuck = sorted(self.in_cell(), key=key_order)
            stacks = self.group.stacks(stuck, STACK_SECONDS)
            raise SessionEnded(*self._stuck_message(stuck, stacks))

    def _failed(self) -> bool:
        """A process's cell raised (not an interrupt, not the user quitting its debugger)."""
        return any(isinstance(record, Failed) and not record.interrupted and key not in self.quit
                   for key, record in self.records.items())

    def _stopping(self) -> bool:
        return self.interrupt_sent is not None or bool(self.quit) or self._failed()

    def _take_events(self, timeout: float) -> None:
        if not self.backlog:
            self.backlog = self.group.events(timeout)
        while self.backlog:  # an interrupt while one is taken leaves it to be taken again, never lost
            self._take(self.backlog[0])
            self.backlog.pop(0)

    def _time_out_cell(self) -> None:
        """``--timeout`` elapsed: interrupt the ranks still in the cell, with where each was; one whose
        cell ended while the stacks were taken is not late."""
        late = sorted(self.in_cell(), key=key_order)
        stacks = self.group.stacks(late, STACK_SECONDS)
        self._take_events(0)
        late = [rank for rank in late if rank in self.in_cell()]
        if late:
            self.timed_out = {rank: stacks.get(rank, "") for rank in late}
            self._interrupt()

    def delivery_summaries(self) -> list[str]:
        """One line per registered loader the cell's ranks iterated."""
        return self._delivery_summaries()

    def _take(self, event: Event) -> None:
        if isinstance(event, Exited) and isinstance(event.rank, Producer):
            self._producer_exited(event)
        elif isinstance(event, Exited):
            self.output.finish(event.rank)
            record = self.records.get(event.rank)
            if isinstance(record, CellEnded) and record.exited:
                why = f"rank {event.rank} ended the session with {record.exited}"
            else:
                why = f"rank {event.rank} {_describe_exit(event.returncode) if event.returncode else 'exited'}"
            tail = [] if event.returncode == 0 else self.output.tail(event.rank)
            raise SessionEnded(*_ended_message(f"{why}: its process group cannot continue", tail))
        self._handle(event)

    def _producer_exited(self, event: Exited) -> None:
        """A producer that built its share of a stream cut by ``--units`` is done; one that failed or
        died leaves its loader's ranks waiting for elements that never come, so the session ends."""
        self.output.finish(event.rank)
        if event.returncode == 0:
            return
        self.exits[event.rank] = (event.returncode, time.monotonic())
        failures = self.failures() or [Failure(event.rank, time.monotonic(), _describe_exit(event.returncode),
                                               self.output.tail(event.rank))]
        message, lines = self._failure_message(failures)
        lines = [line.replace("stopped by taas after", "interrupted by taas after") for line in lines]
        raise SessionEnded(f"{message}; the session ended",
                           lines + [f"{RED}{BOLD}taas: the session ended: {self._name(event.rank)} cannot serve "
                                    f"its loader any more{RESET}"])

    def _interrupt(self) -> None:
        ranks = sorted(self.in_cell(), key=key_order)
        self.stopped |= set(ranks)
        self.group.signal(signal.SIGINT, ranks)
        self.interrupt_sent = time.monotonic()

    def _stuck_message(self, stuck: list[Key], stacks: dict[Key, str]) -> tuple[str, list[str]]:
        names = self._names(stuck)
        message, lines = _ended_message(f"{names} did not leave the interrupted cell within {RETURN_SECONDS:g} s "
                                        "(a collective waits for its peers there, or the code ignores interrupts)")
        for rank in stuck:
            lines.append(f"{BOLD}{self._name(rank)} was here:{RESET}")
            lines += user_stack(stacks.get(rank, ""), self.cell_names) or ["(no stack received)"]
        failures = self.failures()
        if failures:  # why they were interrupted: the failure comes first
            failed, failed_lines = self._failure_message(failures)
            return f"{failed}; {message}", failed_lines + lines
        return message, lines

    def raise_outcome(self) -> None:
        failures = self.failures()
        if failures:
            message, lines = self._failure_message(failures)
            lines = [line.replace("stopped by taas after", "interrupted by taas after") for line in lines]
            raise RankFailed(message, lines + ["taas: the session goes on (%taas debug opens the debugger "
                                               f"in {self._name(failures[0].rank)} at the error)"])
        if self.timed_out is not None:
            raise RunTimedOut(*self._session_timeout())
        if self.interrupted:
            quit = f"the debugger was quit in {self._names(sorted(self.quit, key=key_order))}; " if self.quit else ""
            stopped = f"taas interrupted the cell in {self._names(sorted(self.stopped, key=key_order))}; " \
                if self.stopped else ""
            raise RunInterrupted([f"{RED}{BOLD}KeyboardInterrupt{RESET}: {quit}{stopped}the session goes on"])

    def _session_timeout(self) -> tuple[str, list[str]]:
        message, lines = self._timeout_message()
        message = message.replace("now stopped", "now interrupted; the session goes on")
        return message, [line.replace("now stopped", "now interrupted; the session goes on") for line in lines]


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


def _uninterrupted(call: Callable[[], None]) -> None:
    """Run ``call`` to its end even if the user interrupts meanwhile (the interrupt is raised after it).

    Sending a cell must be whole or not at all, and known to be which: an interrupt that landed
    just after the message went, and before the kernel noted it, would leave the ranks running a
    cell the kernel believes it never sent.
    """
    with containment.HeldInterrupts():
        call()


def _ended_message(why: str, details: list[str] | None = None) -> tuple[str, list[str]]:
    message = f"taas: the session ended: {why}"
    lines = [f"{RED}{BOLD}{message}{RESET}"] + (["last lines it wrote to stderr:"] + details if details else [])
    return plain(message), lines


def debug_paused(group: SessionGroup, rank: int, spec: LaunchSpec, write: Callable[[str, str], object],
                 read_line: ReadLine) -> None:
    """``%taas debug`` after a one-shot ``--debug`` cell of ``spec``: the debugger in the rank paused at
    its error; the run is over once the user leaves it."""
    spec = dataclasses.replace(spec, output="all", timeout=None)  # every line of the debugger, for as long as it takes
    out = RankOutput(write, prefix=spec.show_rank_prefix)
    watch = _CellWatch(spec, out, {}, group, [rank], read_line, write)
    try:
        watch.until_ended(lambda: group.run_cell(SessionCell(None), [rank], ()))
    finally:
        out.finish()
        group.close()
