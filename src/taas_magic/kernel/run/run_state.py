"""The run state machine: what a run's events mean and what to do about them, with no I/O at all.

A run is the set of processes taas watches until each has ended its work: ranks, and the data
producers that feed them. ``RunState`` takes what happens — a process's report, its result, its
exit, its debugger's prompt, the clock, the user's interrupt — and answers with actions for the
pump (``controller.Pump``) to carry out: send a signal, take the stacks of the late ranks, redraw
the live view, ask the user for a line or answer for them, end the session. Once the run is over,
``result()`` is its frozen ``RunResult``, and ``render`` words every message from that (the policies and
the result are in ``run_result.py``, the actions in ``run_actions.py``, a stop's signals in ``run_stop.py``).

    RUNNING ──(a failure · every rank done · --timeout · an interrupt)──► STOPPING ──► OVER

One-shot cells and session cells are two ``Policy`` values over this one machine:

- ``ONE_SHOT``: a stop sends SIGTERM, then SIGKILL 3 s later (an interrupt: SIGINT, SIGTERM after
  3 s, SIGKILL after 6 s; another interrupt sends the next one now); the work is over when every
  process has exited (but a rank paused at its error by ``--debug``).
- ``SESSION``: the ranks outlive the cell. A stop interrupts the cell in the ranks still in it
  (an interrupt or ``--timeout``: first ``STOP_TOGETHER``, before the same optimizer step, then SIGINT
  2 s later; a failure: SIGINT); the work is over when each rank of the cell has said how the cell
  ended there. A rank that exits, a producer that dies, ranks that do not leave an interrupted cell
  within 5 s of their SIGINT and an interrupt after it end the session.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable, Mapping

from taas_magic.kernel.diagnosis.hang import Hang, Process, progressed
from taas_magic.kernel.diagnosis.stacks import split_positions
from taas_magic.kernel.run.run_actions import (
    Action,
    Answer,
    AskLine,
    EndSession,
    MarkEnded,
    ShowHang,
    ShowView,
    Signal,
    TakeStacks,
    Why,
)
from taas_magic.kernel.run.run_ledger import Ledger, own_and_broken
from taas_magic.kernel.run.run_result import (
    EndCause,
    Failure,
    Outcome,
    Policy,
    RunResult,
    SessionEnd,
    first_outcome,
    quit_debugger,
)
from taas_magic.kernel.run.run_stop import Stop, StopCause
from taas_magic.wire.events import NODE_LOST, Key, Producer, key_order
from taas_magic.wire.records import (
    CellEnded,
    Failed,
    RankActivity,
    RankProgress,
    Record,
    SavedOnNode,
    SaveSkipped,
)

VIEW_SECONDS = 0.25  # the live view is redrawn at most this often
VIEW_FIRST_SECONDS = 0.5  # a run shorter than this shows its summary alone: a view drawn for an instant is noise


class Phase(Enum):
    RUNNING = "running"  # the processes work
    STOPPING = "stopping"  # taas stops them: signals escalate, or the ranks leave an interrupted cell
    OVER = "over"  # every process's work is over, or the session ended


# -- the machine ----------------------------------------------------------------------------------
class RunState:
    """One run's state: events and the clock in, actions out (see the module's docstring).

    ``ranks`` are a session cell's ranks; ``deadline`` is when ``--timeout`` elapses (the clock stops
    while a person is at a debugger's prompt: see ``waited``); ``debug`` is ``--debug``.
    """

    def __init__(
        self,
        policy: Policy,
        now: float,
        *,
        ranks: Iterable[int] = (),
        deadline: float | None = None,
        debug: bool = False,
        timeout: float | None = None,
        labels: Mapping[Key, str] | None = None,
        hang_after: float | None = None,
        ranks_per_node: int = 0,
        world: int = 0,
        heals: bool = False,
    ):
        self.policy = policy
        self.started = now
        self.ranks = frozenset(ranks)
        self.deadline = deadline
        self.debug = debug and policy.pauses
        self.timeout = timeout
        self.labels = dict(labels or {})
        self.ledger = Ledger()
        self.running: frozenset[Key] = frozenset()  # as the group said last
        self.stop: Stop | None = None
        self.stopped: set[Key] = set()  # processes taas signalled before they failed on their own
        self.retired: set[Key] = set()  # producers stopped because every rank was done: how they end does not matter
        self.paused: set[int] = set()  # --debug: the rank that raised first, waiting for the debugger
        self.quit: set[Key] = set()  # ranks whose debugger the user quit (q, or an interrupt at its prompt)
        self.late: dict[Key, str] | None = None  # process -> its stack, once --timeout elapsed
        self.interrupted = False
        self.end: SessionEnd | None = None
        self.finished = False
        self.view_shown = 0.0  # when the live view was last drawn
        self.hang_after = hang_after or None  # --hang-after: the watchdog (None or 0: off)
        self.ranks_per_node = ranks_per_node  # > 0 on a cluster: stacks are grouped with their node
        self.world = world  # a session's ranks, those of the cell and the others (--ranks)
        self.heals = heals  # a session whose rank dies goes on, a new process in its place (rank/healing.py)
        self.died: set[int] = set()  # such ranks, dead in this cell
        self.clock = now  # the latest time the machine was told
        self.moved_at = now  # when a process last made progress
        self.hang_shown = False  # the watchdog spoke about the current stall
        self.activity: dict[Key, tuple[RankActivity, float]] = {}  # each rank's latest sample, and when it came
        self.where: tuple[Process, ...] = ()  # see RunResult.where

    @property
    def phase(self) -> Phase:
        if self.end is not None or self.finished:
            return Phase.OVER
        return Phase.RUNNING if self.stop is None else Phase.STOPPING

    def over(self, running: Iterable[Key]) -> bool:
        """Whether the run is over, ``running`` being the processes still running: asked before each step."""
        self.running = frozenset(running)
        if self.end is None:
            if self.policy.keep:
                self.finished = not (self._in_cell() or self.ledger.exiting() or self.ledger.producer_failed())
            else:
                self.finished = not self.running - self.paused
        return self.phase is Phase.OVER

    # -- events ----------------------------------------------------------------------------------
    def reported(self, key: Key, record: Record, now: float | None = None) -> None:
        ledger = self.ledger
        now = self.clock if now is None else now
        if isinstance(record, RankActivity):
            if progressed(self.activity.get(key, (None, now))[0], record):
                self.moved(now)
            self.activity[key] = (record, now)
        elif isinstance(record, (RankProgress, CellEnded, Failed)):
            self.moved(now)
        if isinstance(record, SaveSkipped):
            ledger.saves_skipped.setdefault(record.path, set()).add(key)
        elif isinstance(record, SavedOnNode):
            ledger.saved_on_nodes.append(record)
        elif isinstance(record, (CellEnded, Failed)):
            ledger.records[key] = record
            if quit_debugger(record):
                self.quit.add(key)
            elif (
                self.debug
                and not self.paused
                and isinstance(key, int)
                and isinstance(record, Failed)
                and not record.interrupted
                and not record.peer_lost
            ):  # the debugger goes where the failure is
                self.paused.add(key)  # it waits for the debugger (rank.session.await_debugger)

    def result_sent(self, rank: int, data: Any) -> None:
        self.ledger.results[rank] = data

    def exited(self, key: Key, code: int, now: float, tail: Iterable[str] = ()) -> list[Action]:
        """``key``'s process is gone, with exit status ``code``; ``tail``: the last lines it wrote to stderr."""
        if not self.policy.keep:
            self.ledger.exited(key, code, now, tail, self._died_by_itself(key, code))
            return [MarkEnded(key, "stopped" if key in self.stopped else "failed" if code else "done")]
        if isinstance(key, Producer):
            if code == 0:
                return []  # its share of a stream cut by --units is built and sent
            self.ledger.exited(key, code, now, tail)
            return self._end_session(SessionEnd(EndCause.PRODUCER_DIED, (key,), code))
        if (self.heals or code == NODE_LOST) and isinstance(key, int) and code != 0 and not self.ledger.exiting():
            return self._died(key, code, now, tail)
        return self._end_session(SessionEnd(EndCause.RANK_EXITED, (key,), code, tuple(tail) if code else ()))

    def _died(self, rank: int, code: int, now: float, tail: Iterable[str]) -> list[Action]:
        """A session's rank died (killed, crashed, ``os._exit``): the cell fails with its death, the session goes on
        once a new process is in its place. Its peers leave their collectives with it (its connections closed)."""
        self.ledger.exited(rank, code, now, tail, self._died_by_itself(rank, code))
        self.died.add(rank)
        return [MarkEnded(rank, "failed")]

    def _died_by_itself(self, key: Key, code: int) -> bool:
        """Whether ``key``, which taas was stopping, died before taas's signal reached it (a crash, the OOM killer)."""
        return key in self.stopped and code < 0 and -code not in self._signals_sent()

    def input_requested(self, key: Key, prompt: str) -> list[Action]:
        """``key``'s debugger waits for a line: the user's, or "quit" once the cell is being stopped."""
        if self._stopping():
            self.stopped.add(key)
            return [Answer(key, "quit")]
        return [AskLine(key, prompt)]

    def waited(self, seconds: float) -> None:
        """A person spent ``seconds`` at a prompt: they do not count toward --timeout, nor as a stall."""
        if self.deadline is not None:
            self.deadline += seconds
        self.moved_at += seconds

    def moved(self, now: float) -> None:
        """A process made progress (wrote output, finished a collective, took an element, …)."""
        self.moved_at = max(self.moved_at, now)
        self.hang_shown = False  # a later stall is said again

    def view(self, now: float, changed: bool) -> list[Action]:
        """Whether to redraw the live view, which ``changed`` since it was drawn: at most every
        ``VIEW_SECONDS``, and not in a run's first ``VIEW_FIRST_SECONDS``."""
        if changed and now - self.view_shown >= VIEW_SECONDS and now - self.started >= VIEW_FIRST_SECONDS:
            self.view_shown = now
            return [ShowView(now - self.started)]
        return []

    def tick(self, now: float, running: Iterable[Key]) -> list[Action]:
        """The clock: begin stopping, send the signals that are due, or wake the watchdog."""
        self.running = frozenset(running)
        self.clock = now
        actions = self._decide(now) if self.stop is None else []
        return actions + self._due(now) + ([] if actions else self._watch(now))

    def _watch(self, now: float) -> list[Action]:
        """The watchdog: no process moved for --hang-after seconds; once per stall."""
        if self.hang_after is None or self.hang_shown or self.stop is not None or self.paused:
            return []
        watched = self._watched()
        if now - self.moved_at < self.hang_after or not any(isinstance(key, int) for key in watched):
            return []
        self.hang_shown = True
        return [TakeStacks(watched, Why.HANG)]

    def _watched(self) -> tuple[Key, ...]:
        """The processes a stall concerns: the ranks at work (a session's: in the cell), and the producers."""
        ranks = self._in_cell() if self.policy.keep else {key for key in self.running if isinstance(key, int)}
        producers = {key for key in self.running if not isinstance(key, int)}
        return tuple(sorted((ranks | producers) - self.paused, key=key_order))

    def interrupt(self, now: float, running: Iterable[Key]) -> list[Action]:
        """The user interrupted the cell."""
        self.running = frozenset(running)
        self.clock = now
        return self._interrupt(now) + (self._due(now) if self.policy.interrupt_at_once else [])

    def stacks_taken(
        self, asked: TakeStacks, stacks: Mapping[Key, str], now: float, running: Iterable[Key]
    ) -> list[Action]:
        """The stacks ``asked`` for: the processes still late are stopped; ranks stuck in the cell end the
        session; a stall is shown; a stop goes on, knowing where the processes were."""
        self.running = frozenset(running)
        self.clock = now
        positions, stacks = split_positions(stacks)
        self.activity.update({key: (position, now) for key, position in positions.items()})
        if asked.why is Why.HANG:
            if self.stop is not None:
                return []  # the run is being stopped meanwhile: it does not go on
            return [
                ShowHang(
                    Hang(
                        now - self.moved_at,
                        self.processes(asked.keys, stacks, now),
                        self.hang_after or 0.0,
                        self.ranks_per_node,
                    )
                )
            ]
        if asked.why is Why.STOP:
            self.where = self.processes(asked.keys, stacks, now)
            return []
        if asked.why is Why.STUCK:
            self.where = self.processes(asked.keys, stacks, now)
            return self._end_session(SessionEnd(EndCause.STUCK, asked.keys, stacks=dict(stacks)))
        late = self._late()
        still = [key for key in asked.keys if key in late]  # one that ended its cell meanwhile is not late
        if still:
            self.late = {key: stacks.get(key, "") for key in still}
            self.where = self.processes(tuple(still), stacks, now)
            self.paused.clear()  # the time is up for the paused rank too
            self._begin(StopCause.TIMEOUT, now)
        return self._due(now)

    # -- decisions --------------------------------------------------------------------------------
    def _decide(self, now: float) -> list[Action]:
        working = self.running - self.paused
        if self._failing():
            self._begin(StopCause.FAILURE, now)
            return self._where_stopped()
        elif self.quit:
            return self._interrupt(now)  # quitting a debugger is the user stopping the run: never restarted
        elif not self.policy.keep and working and not any(isinstance(key, int) for key in working):
            self.retired = set(working)  # every rank is done: the producers' work is over
            self._begin(StopCause.FINISHED, now)
        elif self.deadline is not None and now >= self.deadline:
            return [TakeStacks(tuple(sorted(self._late(), key=key_order)), Why.LATE)]
        return []

    def _interrupt(self, now: float) -> list[Action]:
        self.interrupted = True
        self.paused.clear()  # an interrupt stops every rank, the paused one too
        if self.stop is not None and self.policy.again_ends:
            ahead = self.stop.skip_ahead(now) if self.stop.cause in (StopCause.INTERRUPT, StopCause.TIMEOUT) else []
            if ahead:  # an impatient interrupt while the ranks stop together: they stop where they are now
                return [Signal(signum, self._targets()) for signum in ahead]
            return self._end_session(SessionEnd(EndCause.INTERRUPTED_TWICE))
        if self.stop is not None and self.stop.cause is StopCause.INTERRUPT:
            return [Signal(signum, None) for signum in self.stop.skip_ahead(now)]
        self._begin(StopCause.INTERRUPT, now)
        return self._where_stopped()

    def _where_stopped(self) -> list[Action]:
        """Before the signals of a stop: where the ranks it stops are (they may be stuck waiting for each other)."""
        ranks = tuple(key for key in self._targets() if isinstance(key, int))
        return [TakeStacks(ranks, Why.STOP)] if ranks else []

    def _begin(self, cause: StopCause, now: float) -> None:
        self.stopped |= set(self._targets())
        steps = {StopCause.INTERRUPT: self.policy.on_interrupt, StopCause.TIMEOUT: self.policy.on_timeout}
        self.stop = Stop(cause, steps.get(cause, self.policy.on_failure), now)

    def _due(self, now: float) -> list[Action]:
        """The signals due by ``now``; the stacks of ranks that did not leave an interrupted cell in time."""
        if self.stop is None or self.end is not None:
            return []
        actions: list[Action] = [Signal(signum, self._targets()) for signum in self.stop.due(now)]
        leave = self.policy.leave_seconds
        if leave is not None and self.stop.all_sent_before(now, leave) and self._in_cell():
            actions.append(TakeStacks(self._targets(), Why.STUCK))
        return actions

    def _signals_sent(self) -> set[int]:
        return set() if self.stop is None else self.stop.signals_sent()

    def _end_session(self, end: SessionEnd) -> list[Action]:
        self.end = end
        return [EndSession()]

    # -- what the run is at -----------------------------------------------------------------------
    def processes(self, keys: Iterable[Key], stacks: Mapping[Key, str], now: float) -> tuple[Process, ...]:
        """``keys`` with their stacks and latest activity, and the ranks that already left, with how."""
        keys = set(keys)
        known = keys | set(self.activity) | self.ledger.keys() | set(self.ranks) | set(range(self.world))
        processes = []
        for key in sorted(known, key=key_order):
            if key not in keys and not isinstance(key, int):
                continue
            activity, came = self.activity.get(key, (None, now))
            processes.append(
                Process(
                    key,
                    self.labels.get(key, f"rank {key}"),
                    activity,
                    max(0.0, now - came),
                    stacks.get(key, ""),
                    "" if key in keys else self._how_left(key),
                )
            )
        return tuple(processes)

    def _how_left(self, key: Key) -> str:
        if self.policy.keep and key not in self.ranks:
            return "is not in this cell (--ranks)"
        return self.ledger.how_left(key, self.running, self.stopped)

    def _targets(self) -> tuple[Key, ...]:
        """What a stop signals: a session's ranks still in the cell; else every running process but a paused rank."""
        return tuple(sorted(self._in_cell() if self.policy.keep else self.running - self.paused, key=key_order))

    def _late(self) -> set[Key]:
        """The processes still at their work when the time runs out (one sending its names back is not)."""
        return self._in_cell() if self.policy.keep else set(self.running - set(self.ledger.records))

    def _in_cell(self) -> set[Key]:
        return {rank for rank in self.ranks if rank not in self.ledger.records and rank not in self.died}

    def _failing(self) -> bool:
        """A process failed on its own: the others are stopped."""
        return any(self.policy.own_interrupt_stops or not failure.interrupted for failure in self.failures())

    def _stopping(self) -> bool:
        """Whether the processes are being stopped (a failure, a quit debugger, an interrupt, --timeout)."""
        return self.stop is not None or bool(self.quit) or self._failing()

    def failures(self) -> list[Failure]:
        """The processes that failed on their own, the first to fail (the root cause) first."""
        return self._failures()[0]

    def _failures(self) -> tuple[list[Failure], list[Failure]]:
        """The processes that failed on their own, the root cause first; and those a failure only broke."""
        if self.policy.keep:  # a session's ranks stay: their cell ended when they said so, or as they died
            ended = {key: (0, self.started) for key in self.ledger.records}
            ended.update({rank: self.ledger.exits[rank] for rank in self.died})
        else:
            ended = dict(self.ledger.exits)
            ended.update({rank: (0, self.started) for rank in self.paused})  # it failed, and waits
        failures = self.ledger.failures(ended, left_out=self.retired, stopped=self.stopped, quit=self.quit)
        return own_and_broken(failures)

    def result(self) -> RunResult:
        ledger, end = self.ledger, self.end
        failures, broken = self._failures()
        if end is not None and end.cause is EndCause.PRODUCER_DIED and not failures:
            code, when = ledger.exits[end.keys[0]]  # it died without a word
            failures = [Failure(end.keys[0], when, ledger.tails.get(end.keys[0], ()), code=code)]
        outcome = (
            Outcome.SESSION_ENDED
            if end is not None
            else first_outcome(self.policy.order, self.interrupted, self.late is not None, bool(failures))
        )
        return RunResult(
            policy=self.policy,
            outcome=outcome,
            failures=tuple(failures),
            broken=tuple(broken),
            results=dict(ledger.results),
            skipped=ledger.skipped(),
            records=dict(ledger.records),
            exits={key: code for key, (code, _) in ledger.exits.items()},
            stopped=frozenset(self.stopped),
            quit=frozenset(self.quit),
            late=None if self.late is None else dict(self.late),
            interrupted=self.interrupted,
            saves_skipped={path: frozenset(keys) for path, keys in ledger.saves_skipped.items()},
            saved_on_nodes=tuple(ledger.saved_on_nodes),
            end=end,
            labels=dict(self.labels),
            timeout=self.timeout,
            where=self._where_with(broken),
            ranks_per_node=self.ranks_per_node,
        )

    def _where_with(self, broken: list[Failure]) -> tuple[Process, ...]:
        """Where the processes were, with every rank a failure broke: one that exited before taas took
        stacks (or before it knew of the failure at all) is placed by its last sample and its error."""
        missing = {failure.rank for failure in broken} - {process.key for process in self.where}
        if not missing:
            return self.where
        found = [process for process in self.processes((), {}, self.clock) if process.key in missing]
        return tuple(sorted(self.where + tuple(found), key=lambda process: key_order(process.key)))
