"""One taas run from start to finish: start the ranks, pump their output, watch, stop, report.

The only place that decides a run's outcome. Every way out — success, a failing rank, a
timeout, an interrupt, an error of our own — passes through ``RankGroup.close``, so no
process, pipe or port outlives the cell.

Stopping escalates: a failure or timeout sends SIGTERM, then SIGKILL after 3 s; an interrupt
sends SIGINT (so `finally` blocks and Lightning's shutdown run), SIGTERM after 3 s, SIGKILL
after 6 s. Interrupting again skips to the next step.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, TypeVar

from taas_magic.launch.backend import Backend, RankGroup
from taas_magic.wire.events import Event, Exited, InputRequest, Key, Output, Report, Result, key_order
from taas_magic.kernel.environment import rank_environments
from taas_magic.errors import RankFailed, RunTimedOut
from taas_magic.kernel.live_view import RunView
from taas_magic.wire.records import CellEnded, DeliverySummary, Failed, Record, SavedOnNode, SaveSkipped
from taas_magic.launch.rendezvous import new_run_id
from taas_magic.kernel.spec import LaunchSpec
from taas_magic.kernel.streams import RankOutput
from taas_magic.kernel.tidy_output import TidyRankOutput

POLL_SECONDS = 0.05
ON_FAILURE = ((0.0, signal.SIGTERM), (3.0, signal.SIGKILL))
ON_INTERRUPT = ((0.0, signal.SIGINT), (3.0, signal.SIGTERM), (6.0, signal.SIGKILL))
STACK_SECONDS = 2.0
VIEW_SECONDS = 0.25  # the live view is redrawn at most this often
VIEW_FIRST_SECONDS = 0.5  # a run shorter than this shows its summary alone: a view drawn for an instant is noise

RED, BOLD, RESET = "\x1b[0;31m", "\x1b[1m", "\x1b[0m"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
Value = TypeVar("Value")


class RunInterrupted(KeyboardInterrupt):
    """The cell was interrupted; every rank has been stopped."""

    def __init__(self, lines: list[str]):
        super().__init__(plain(lines[0]) if lines else "")  # the error's evalue: stored and shown as text
        self.lines = lines

    def _render_traceback_(self) -> list[str]:
        return self.lines


@dataclass
class _Escalation:
    """Signals to send at given delays after stopping began."""

    steps: tuple[tuple[float, int], ...]
    started: float = field(default_factory=time.monotonic)
    sent: int = 0

    def due(self, now: float) -> list[int]:
        due = [sig for delay, sig in self.steps[self.sent :] if now - self.started >= delay]
        self.sent += len(due)
        return due

    def skip_ahead(self) -> list[int]:
        """An impatient second interrupt: the next step now."""
        if self.sent >= len(self.steps):
            return []
        self.sent += 1
        return [self.steps[self.sent - 1][1]]


@dataclass(frozen=True)
class Failure:
    rank: Key
    time: float
    summary: str  # one line: "ValueError: boom" or "killed by signal SIGSEGV"
    details: list[str]  # traceback lines, or the last stderr lines of a crash
    where: str = ""  # what the process was doing: "at element 5 of pass 0 (samples …)"
    hint: str = ""  # advice for a mistake the rank recognized: "this run is on CPU …"


@dataclass(frozen=True)
class Outcome:
    """What a successful run hands back: rank 0's pickled names and those it could not send."""

    results: bytes
    skipped: dict[str, str]


def run(spec: LaunchSpec, task: object, backend: Backend, write: Callable[[str, str], object],
        kernel_environ: Mapping[str, str], cell_names: Mapping[str, str] | None = None,
        labels: Mapping[Key, str] | None = None, status: Callable[[dict[str, str], bool], object] | None = None,
        keep_paused: Callable[[RankGroup, int], None] | None = None,
        read_line: Callable[[str], str] | None = None) -> Outcome:
    """Run ``task`` as the ranks of ``spec``; return on success, raise what the cell should show otherwise.

    ``labels`` names the processes that are not ranks (data producers, keyed ``Producer``);
    ``status`` shows the live view (a MIME bundle, redrawn in place; None: no view, the ranks'
    output as they write it); ``read_line`` asks the user for a line a rank's debugger waits for
    (`breakpoint()`).

    With ``--debug``, the first rank whose cell raised stays, paused at its error, while the others
    are stopped; the group is handed to ``keep_paused`` instead of being closed.

    With ``--max-restarts N``, a run that failed because a rank did (not an interrupt, not
    ``--timeout``, which counts from the cell's start) is started again, up to N times, each time
    with a fresh run id and rendezvous and ``TORCHELASTIC_RESTART_COUNT`` one higher.
    """
    labels = dict(labels or {})
    deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
    first_id = new_run_id()
    for restart in range(spec.max_restarts + 1):
        # MASTER_PORT is opened by the backend, on a socket it holds for the run alone.
        envs = rank_environments(spec, first_id if restart == 0 else new_run_id(), 0, kernel_environ,
                                 restart=restart, elastic_id=first_id)
        watch = _attempt(spec, task, backend, envs, write, cell_names or {}, labels,
                         status, deadline, keep_paused, read_line)
        deadline = watch.deadline  # later by the time a person spent at a debugger prompt
        failure = watch.rank_failure()
        if failure is None or restart == spec.max_restarts:
            break
        write("stderr", f"taas: {failure}: every rank starts again (restart {restart + 1} of "
                        f"--max-restarts {spec.max_restarts})\n")
    if spec.max_restarts and failure is not None:
        write("stderr", f"taas: --max-restarts {spec.max_restarts} spent: the cell fails with the last failure\n")
    watch.raise_outcome()
    return Outcome(watch.results, watch.skipped_names())


def _attempt(spec: LaunchSpec, task: object, backend: Backend, envs: dict[int, dict[str, str]],
             write: Callable[[str, str], object], cell_names: Mapping[str, str], labels: dict[Key, str],
             status: Callable[[dict[str, str], bool], object] | None, deadline: float | None,
             keep_paused: Callable[[RankGroup, int], None] | None,
             read_line: Callable[[str], str] | None) -> "_Watch":
    """One start of the run, watched to its end; its outcome is the watch's to raise."""
    output, view = live_output(spec, write, list(range(spec.world_size)), status, labels)
    watch = _Watch(spec, output, cell_names, labels, write, read_line, view, status)
    try:
        group = backend.start(envs, task)
        try:
            watch.until_done(group, deadline)
            watch.show_view(final=True)
        finally:
            if watch.paused and keep_paused is not None and group.running() == watch.paused:
                keep_paused(group, next(iter(watch.paused)))  # type: ignore[arg-type]
            else:
                group.close()
    finally:
        output.finish()
        for line in watch.notices():
            write("stderr", line + "\n")
    return watch


def live_output(spec: LaunchSpec, write: Callable[[str, str], object], ranks: list[int],
                status: Callable[[dict[str, str], bool], object] | None, labels: Mapping[Key, str] | None = None
                ) -> tuple[RankOutput, RunView | None]:
    """Where the ranks' output goes: with a live view (``status``), tidied, bars into the view's rows."""
    shown = None if spec.output == "all" else {0}
    if status is None:
        return RankOutput(write, prefix=spec.show_rank_prefix, shown=shown, labels=labels), None
    view = RunView(f"{len(ranks)} rank{'s' * (len(ranks) != 1)} on {spec.device}", ranks,
                   spec.ranks_per_node if spec.nodes > 1 else 0)
    return TidyRankOutput(write, spec.show_rank_prefix, len(ranks), view.bar, shown, labels), view


class _Watch:
    """Consumes a group's events and steers it until every rank has exited."""

    def __init__(self, spec: LaunchSpec, output: RankOutput, cell_names: Mapping[str, str],
                 labels: dict[Key, str], write: Callable[[str, str], object],
                 read_line: Callable[[str], str] | None, view: RunView | None = None,
                 status: Callable[[dict[str, str], bool], object] | None = None):
        self.spec = spec
        self.write = write
        self.read_line = read_line
        self.group: RankGroup | None = None
        self.output = output
        self.cell_names = cell_names  # code file name -> "Cell In[5]", for stacks
        self.labels = labels
        self.view = view
        self.status = status  # shows the view
        self.started = time.monotonic()
        self.records: dict[Key, CellEnded | Failed] = {}  # how each process's work ended
        self.results = b""
        self.saves_skipped: dict[str, set[Key]] = {}  # path -> ranks whose torch.save was skipped
        self.saved_on_nodes: list[SavedOnNode] = []  # rank 0's saves that stay on a cluster node
        self.exits: dict[Key, tuple[int, float]] = {}
        self.stopped: set[Key] = set()  # ranks we signalled before they failed on their own
        self.retired: set[Key] = set()  # producers stopped because every rank was done: how they end does not matter
        self.escalation: _Escalation | None = None
        self.timed_out: dict[Key, str] | None = None  # rank -> stack, when --timeout elapsed
        self.interrupted = False
        self.paused: set[Key] = set()  # --debug: the rank that raised first, waiting for the debugger
        self.quit: set[Key] = set()  # ranks whose debugger the user quit (q, or an interrupt at its prompt)
        self.deadline: float | None = None  # when --timeout elapses; the clock stops while a person is at a prompt
        self.view_shown = 0.0  # when the view was last drawn

    def until_done(self, group: RankGroup, deadline: float | None) -> None:
        self.group = group
        self.deadline = deadline
        while group.running() - self.paused:
            try:
                self._step(group)
            except KeyboardInterrupt:
                self._on_interrupt(group)

    def _step(self, group: RankGroup) -> None:
        for event in group.events(POLL_SECONDS):
            self._handle(event)
        self.output.flush_idle()
        self.show_view()
        now = time.monotonic()
        running = group.running() - self.paused
        if self.escalation is None and self.failures():
            self._begin_stop(group, ON_FAILURE)
        elif self.escalation is None and self.quit:
            self._on_interrupt(group)  # quitting the debugger is the user stopping the run: never restarted
        elif self.escalation is None and _only_producers(running):
            self.retired = running  # every rank is done: the producers' work is over
            self._begin_stop(group, ON_FAILURE)
        elif self.escalation is None and self.deadline is not None and now >= self.deadline:
            self._time_out(group)
        if self.escalation is not None:
            for signum in self.escalation.due(time.monotonic()):
                group.signal(signum, group.running() - self.paused)

    def _time_out(self, group: RankGroup) -> None:
        """``--timeout`` elapsed: stop the processes still at work, with where each was. One that ended its
        cell meanwhile (it is sending its names back) is not late: it is neither named nor stopped."""
        late = [key for key in sorted(group.running(), key=key_order) if key not in self.records]
        stacks = group.stacks(late, STACK_SECONDS) if late else {}
        for event in group.events(0):
            self._handle(event)
        late = [key for key in late if key in group.running() and key not in self.records]
        if late:
            self.timed_out = {key: stacks.get(key, "") for key in late}
            self.paused.clear()  # the time is up for the paused rank too
            self._begin_stop(group, ON_FAILURE)

    def _on_interrupt(self, group: RankGroup) -> None:
        self.interrupted = True
        self.paused.clear()  # an interrupt stops every rank, the paused one too
        if self.escalation is None or self.escalation.steps is not ON_INTERRUPT:
            self._begin_stop(group, ON_INTERRUPT)
        else:
            for signum in self.escalation.skip_ahead():
                group.signal(signum)

    def _begin_stop(self, group: RankGroup, steps: tuple[tuple[float, int], ...]) -> None:
        self.stopped |= group.running() - self.paused
        self.escalation = _Escalation(steps)

    def _handle(self, event: Event) -> None:
        if isinstance(event, Output):
            self.output.feed(event.rank, event.stream, event.data)
        elif isinstance(event, Report):
            self._take_record(event.rank, event.record)
        elif isinstance(event, Result):
            self.results = event.data
        elif isinstance(event, Exited):
            self.exits[event.rank] = (event.returncode, time.monotonic())
            self.output.exited(event.rank)
            if self.view is not None:
                self.view.ended(event.rank, "stopped" if event.rank in self.stopped else
                                "failed" if event.returncode else "done")
        elif isinstance(event, InputRequest):
            self.output.finish(event.rank)  # what it printed, whole, before its prompt
            answer = getattr(self.group, "answer", None)
            if answer is None:
                pass
            elif self._stopping():  # the cell is over: the rank leaves its debugger instead of waiting
                self.stopped.add(event.rank)
                answer(event.rank, "quit")
            else:
                answer(event.rank, self._ask(event.prompt))

    def _stopping(self) -> bool:
        """Whether the ranks are being stopped (a rank failed, the user quit a debugger, an interrupt, --timeout)."""
        return self.escalation is not None or bool(self.quit) or bool(self.failures())

    def _ask(self, prompt: str) -> str:
        """A line for a rank's debugger; "quit" on an interrupt, "continue" where none can be typed.

        The time a person takes to answer does not count toward ``--timeout``: its deadline moves on by as much.
        """
        asked = time.monotonic()
        try:
            if self.read_line is None:
                raise EOFError
            return self.read_line(prompt)
        except KeyboardInterrupt:
            return "quit"  # the rank's breakpoint raises BdbQuit: the run then stops as on an interrupt
        except Exception:  # the front end takes no input (a script, a test): the rank goes on
            self.write("stderr", "taas: no input can be read here: the debugger continues\n")
            return "continue"
        finally:
            if self.deadline is not None:
                self.deadline += time.monotonic() - asked

    def _take_record(self, key: Key, record: Record) -> None:
        if self.view is not None:
            self.view.take(key, record)  # progress, delivery counters and vitals are the view's alone
        if isinstance(record, SaveSkipped):
            self.saves_skipped.setdefault(record.path, set()).add(key)
        elif isinstance(record, SavedOnNode):
            self.saved_on_nodes.append(record)
        elif isinstance(record, (CellEnded, Failed)):
            self.records[key] = record
            if _quit_debugger(record):
                self.quit.add(key)
            elif (self.spec.debug and not self.paused and isinstance(key, int) and isinstance(record, Failed)
                    and not record.interrupted):
                self.paused.add(key)  # it waits for the debugger (session_rank.await_debugger)

    def show_view(self, final: bool = False) -> None:
        """The live view, redrawn when it changed, at most every ``VIEW_SECONDS``; its summary once the run is over."""
        if self.view is None or self.status is None:
            return
        now = time.monotonic()
        if final:
            self.status(self.view.summary(self.outcome(), now - self.started), True)
        elif self.view.changed and now - self.view_shown >= VIEW_SECONDS and now - self.started >= VIEW_FIRST_SECONDS:
            self.view.changed = False
            self.status(self.view.render(now - self.started), False)
            self.view_shown = now

    def outcome(self) -> str:
        """How the run went, in a word or two: done, failed, interrupted, timed out."""
        if self.interrupted:
            return "interrupted"
        if self.timed_out is not None:
            return "timed out"
        return "failed" if self.failures() else "done"

    def skipped_names(self) -> dict[str, str]:
        """Rank 0's names that could not be sent back, and why."""
        ended = self.records.get(0)
        return ended.skipped if isinstance(ended, CellEnded) else {}

    # -- outcome ----------------------------------------------------------------------------
    def notices(self) -> list[str]:
        """One line per cell for each kind of thing taas did on the user's behalf."""
        return self._saved_on_nodes() + self._save_notices() + self._delivery_summaries()

    def _saved_on_nodes(self) -> list[str]:
        return [f"taas: rank 0 saved {record.path} on node {record.node}: a file saved under an absolute path stays "
                "on its node (save under a relative path to have it copied here)" for record in self.saved_on_nodes]

    def _delivery_summaries(self) -> list[str]:
        per_loader: dict[str, list[DeliverySummary]] = {}
        for rank, record in _in_order(self.records):
            for name, summary in (record.delivery if isinstance(record, CellEnded) else {}).items():
                per_loader.setdefault(name, []).append(summary)
        lines = []
        for name, summaries in sorted(per_loader.items()):
            taken = sum(s.taken for s in summaries)
            span = max((s.span for s in summaries), default=0.0)
            waited = sum(s.waited for s in summaries) / len(summaries)
            share = waited / span if span > 0 else 0.0
            first = max(s.first_wait for s in summaries)
            rate = f"{taken / span:,.0f} elements/s" if span > 0 else "—"
            ranks = f"{len(summaries)} rank{'s' if len(summaries) != 1 else ''}"
            lines.append(f"taas: {name}: {taken} elements delivered to {ranks}, {rate}, "
                         f"ranks waited for data {share:.0%} of the time (first element after {first * 1000:.0f} ms)")
        return lines

    def _save_notices(self) -> list[str]:
        if not self.saves_skipped:
            return []
        paths = ", ".join(repr(path) for path in sorted(self.saves_skipped))
        ranks = sorted(key for keys in self.saves_skipped.values() for key in keys if isinstance(key, int))
        return [f"taas: torch.save to {paths} skipped in {_ranks(ranks)}: only rank 0 writes files "
                "(guard other writes with taas.is_main())"]

    def failures(self) -> list[Failure]:
        """The processes that failed on their own, the first to fail (the root cause) first."""
        failures = []
        for rank, (code, when) in _in_order(self._ended()):
            record = self.records.get(rank)
            if rank in self.retired:
                continue  # stopped after the ranks needed nothing more (its DataLoader's workers may die first)
            if isinstance(record, Failed):
                if (record.interrupted and rank in self.stopped) or rank in self.quit:
                    continue  # we interrupted it, or the user quit its debugger
                summary = f"{record.ename}: {record.evalue}".rstrip(": ")
                failures.append(Failure(rank, record.time or when, summary, record.traceback, record.where,
                                        record.hint))
            elif code != 0 and rank not in self.stopped:
                failures.append(Failure(rank, when, _describe_exit(code), self.output.tail(rank)))
        return sorted(failures, key=lambda f: f.time)

    def _ended(self) -> dict[Key, tuple[int, float]]:
        """The processes whose work is over: (exit status, when), by key."""
        ended = dict(self.exits)
        ended.update({rank: (0, self.started) for rank in self.paused})  # it failed, and waits
        return ended

    def rank_failure(self) -> str | None:
        """The one-line failure when the run failed because a rank did (not an interrupt or a timeout)."""
        failures = self.failures()
        if self.interrupted or self.timed_out is not None or not failures:
            return None
        return self._failure_message(failures)[0]

    def raise_outcome(self) -> None:
        failures = self.failures()
        if self.interrupted:
            raise RunInterrupted(self._interrupt_lines())
        if self.timed_out is not None:
            raise RunTimedOut(*self._timeout_message())
        if failures:
            raise RankFailed(*self._failure_message(failures))

    def _failure_message(self, failures: list[Failure]) -> tuple[str, list[str]]:
        root = failures[0]
        who = self._name(root.rank)
        message = f"{who} failed{' ' + root.where if root.where else ''}: {root.summary}"
        lines = [f"{RED}{BOLD}taas: {message}{RESET}"]
        ended = self._ended_before(root.time)
        if ended:
            lines.append(f"{BOLD}before {who} failed: {ended}{RESET}")
        if root.details:
            lines += [f"{BOLD}{who}'s traceback:{RESET}" if _is_traceback(root) else
                      f"{BOLD}last lines {who} wrote to stderr:{RESET}"]
            lines += root.details
        if root.hint:
            lines.append(f"{BOLD}taas: {root.hint}{RESET}")
        others = [f"{self._name(f.rank)} ({f.summary})" for f in failures[1:]]
        stopped = sorted(self.stopped - {f.rank for f in failures}, key=key_order)
        if others:
            lines.append(f"also failed, after {who}: " + "; ".join(others))
        if stopped:
            lines.append(f"stopped by taas after the failure: {self._names(stopped)}")
        return plain(message), lines

    def _ended_before(self, moment: float) -> str:
        """Ranks whose cell ended without error before ``moment``: often why the others failed or hung.

        A rank that called sys.exit(0) ended as if it succeeded, but left its peers' collectives;
        so did one that left without a word (``os._exit(0)``).
        """
        ranks_by_end: dict[str, list[int]] = {}
        for rank, record in _in_order(self.records):
            if isinstance(rank, int) and isinstance(record, CellEnded) and record.time < moment:
                how = f"exited early with {record.exited}" if record.exited else "had finished the cell"
                ranks_by_end.setdefault(how, []).append(rank)
        for rank, code in self._left_unfinished():
            ranks_by_end.setdefault(_describe_exit(code), []).append(rank)
        return "; ".join(f"{_ranks(ranks)} {how}" for how, ranks in ranks_by_end.items())

    def _left_unfinished(self) -> list[tuple[int, int]]:
        """(rank, exit status) of ranks that exited with status 0 while their cell ran (``os._exit(0)``).

        Not failures (a non-zero status is one, named as such), so nothing else names them. Not
        stopped by taas: they left before taas knew of a failure or a timeout. That order, not the
        clock, puts them before the failure: taas sees an exit a moment after it happened, and the
        peer it broke may have timed its own failure earlier.
        """
        return [(rank, code) for rank, (code, _) in _in_order(self.exits)
                if isinstance(rank, int) and code == 0 and rank not in self.records and rank not in self.stopped]

    def _name(self, key: Key) -> str:
        return self.labels.get(key, f"rank {key}")

    def _names(self, keys: list[Key]) -> str:
        ranks = sorted(key for key in keys if isinstance(key, int))
        others = [self._name(key) for key in sorted(keys, key=key_order) if not isinstance(key, int)]
        return "; ".join(([_ranks(ranks)] if ranks else []) + others)

    def _timeout_message(self) -> tuple[str, list[str]]:
        assert self.timed_out is not None
        late = sorted(self.timed_out, key=key_order)
        message = f"--timeout {self.spec.timeout:g} s elapsed: {self._names(late)} still running, now stopped"
        lines = [f"{RED}{BOLD}taas: {message}{RESET}"]
        ended = self._ended_before(float("inf"))
        if ended:
            lines.append(f"{BOLD}before the time ran out: {ended}{RESET}")
        for rank in late:
            lines.append(f"{BOLD}{self._name(rank)} was here when the time ran out:{RESET}")
            lines += user_stack(self.timed_out[rank], self.cell_names) or ["(no stack received)"]
        return message, lines

    def _interrupt_lines(self) -> list[str]:
        how = ", ".join(f"{rank}: {_describe_stop(code, self.records.get(rank))}"
                        for rank, (code, _) in _in_order(self.exits) if isinstance(rank, int))
        return [f"{RED}{BOLD}KeyboardInterrupt{RESET}: taas run interrupted; every rank stopped ({how})"]


def user_stack(dump: str, cell_names: Mapping[str, str]) -> list[str]:
    """A faulthandler dump cut to what matters: no taas threads, nothing below the cell's code."""
    kept: list[str] = []
    for block in dump.strip().split("\n\n"):
        frames = block.splitlines()
        if not frames or any("taas_magic" in line and " in watch" in line for line in frames):
            continue  # the rank's lifeline thread
        header, frames = frames[0], frames[1:]
        inside = [line for line in _until_taas(frames)]
        for filename, label in cell_names.items():
            inside = [line.replace(f'File "{filename}"', label) for line in inside]
        kept += [header] + inside
    return kept


def _until_taas(frames: list[str]) -> list[str]:
    """Frames above the point where taas started the process's work (most recent first)."""
    for index, line in enumerate(frames):
        if "/taas_magic/rank/worker.py" in line or "/taas_magic/launch/fork/backend.py" in line:
            return frames[:index]
    return frames


def _in_order(by_key: Mapping[Key, Value]) -> list[tuple[Key, Value]]:
    """The items of ``by_key``: ranks first, by number, then producers."""
    return sorted(by_key.items(), key=lambda item: key_order(item[0]))


def _only_producers(running: set[Key]) -> bool:
    return bool(running) and not any(isinstance(key, int) for key in running)


def _is_traceback(failure: Failure) -> bool:
    return not failure.summary.startswith(("killed by", "exited with"))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by signal {name}"
    return f"exited with code {code} before the cell finished"


def plain(text: str) -> str:
    """Text without terminal colours: for an error's one-line value, which Jupyter stores as is."""
    return ANSI.sub("", text)


def _quit_debugger(record: CellEnded | Failed) -> bool:
    """The user quit a ``breakpoint()``'s debugger (``q``, or an interrupt at its prompt): pdb raised BdbQuit."""
    return isinstance(record, Failed) and record.ename == "BdbQuit"


def _describe_stop(code: int, record: CellEnded | Failed | None) -> str:
    if record is not None and _quit_debugger(record):
        return "quit the debugger"
    if isinstance(record, Failed) and record.interrupted:
        return "KeyboardInterrupt"
    if isinstance(record, CellEnded):
        return f"had exited with {record.exited}" if record.exited else "had finished"
    return _describe_exit(code) if code else "exited"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
