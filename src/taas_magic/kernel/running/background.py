"""Taas cells that run in the background (``--background``): the cell returns at once with a handle, the run goes
on in a thread of the kernel, and the notebook runs other cells meanwhile.

The thread runs the whole of a one-shot run (``controller.run``) or of a session's cell (``Session.run``): its ranks'
output, live view, hang reports and summary go to the cell that started it, because ipykernel sends a thread's
output to the cell it was told (``_to_this_cell``), whichever cell runs now. The names the run sends back join the
notebook between cells (before the next cell runs, or in ``wait()``), never while another cell runs: a cell never
sees a name change under it. A stop (``stop()``, ``%taas stop``, the kernel's shutdown) is taken by the run's pump
as an interrupt of the cell would be. While a session's cell runs here, the session is the run's: `%taas pull` goes
through its pump (``PullRequests``: the ranks answer between two optimizer steps), everything else waits for it.

A one-shot run's ranks start from the fork server (or on the cluster's nodes): the kernel is never forked while
another cell runs in it (a thread holding a lock at that moment would leave it held in every rank), and the names
they get are the notebook's as the cell ran, restarts (``--max-restarts``) included. On a cluster, the run's thread
and the notebook's cells take turns with the cluster driver, one message at a time (``driver_link.py``).
"""

from __future__ import annotations

import contextvars
import itertools
import sys
import threading
import time
import traceback
from typing import Any, Callable

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.run.run_result import RunResult
from taas_magic.kernel.view import streams

STOP_WAIT_SECONDS = 30.0  # a run that was asked to stop ends within seconds: an interrupt, then SIGTERM, SIGKILL
WAIT_SLICE_SECONDS = 0.1  # a wait wakes this often, so that an interrupt of the kernel ends it at once


def refuse(args: Any) -> None:
    """A ``--background`` cell's options that a run in the background cannot honour, refused in one line before
    anything starts."""
    if args.keep:
        raise TaasUsageError(
            "--background runs a one-shot cell, or a cell in a running session: start the session (--keep) in the "
            "foreground, then run its cells in the background"
        )
    if args.debug:
        raise TaasUsageError(
            "--debug keeps a failing rank paused for %taas debug, which a run in the background cannot wait for: "
            "leave out --debug or --background"
        )
    if args.start == "fork":
        raise TaasUsageError(
            "--background starts its ranks from the fork server (the kernel is not forked while other cells run "
            "in it): leave out --start fork"
        )


class StopRequests:
    """Stops asked of a run from outside its pump; the pump takes each as one interrupt of the cell (a second one
    stops the ranks at once, as a second interrupt would)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._asked = 0
        self.asked_ever = False

    def ask(self) -> None:
        with self._lock:
            self._asked += 1
            self.asked_ever = True

    def take(self) -> bool:
        """Whether a stop was asked since the last ``take``."""
        with self._lock:
            asked, self._asked = self._asked > 0, max(self._asked - 1, 0)
        return asked


class PendingPull:
    """One `%taas pull` while a session's cell runs in the background: asked by the notebook, carried to the ranks
    by the run's pump, answered by each rank between two steps."""

    def __init__(self, number: int, names: tuple[str, ...], ranks: tuple[int, ...]) -> None:
        self.number, self.names, self.ranks = number, names, ranks
        self.answers: dict[int, Any] = {}
        self.settled = threading.Event()  # every rank answered, or no answer can come (the cell ended)

    def wait(self) -> None:
        """Until settled; an interrupt of the kernel ends the wait (the ranks' answers, if they come, are dropped)."""
        while not self.settled.wait(WAIT_SLICE_SECONDS):
            pass


# Pulls are numbered across the kernel: a rank reads the request that carries a number newer than the last it read
# (on a cluster node, it may be told before node 0 has put the request in the store), and the ranks agree on the
# step to answer one at under its number (``rank/stopping.py``), a key the run's store keeps for the session.
_PULL_NUMBERS = itertools.count(1)


class PullRequests:
    """The pulls of a background session cell: ``Pulls`` for its pump (``front_end.py``), ``ask`` for the notebook."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[PendingPull] = []
        self._asked: dict[int, PendingPull] = {}
        self._ended = False

    def ask(self, names: tuple[str, ...], ranks: tuple[int, ...]) -> PendingPull:
        with self._lock:
            request = PendingPull(next(_PULL_NUMBERS), names, ranks)
            if self._ended:
                request.settled.set()
            else:
                self._queued.append(request)
            return request

    def take(self) -> tuple[int, tuple[str, ...], tuple[int, ...]] | None:
        with self._lock:
            if not self._queued or self._asked:  # one at a time: the ranks read one request from the store
                return None
            request = self._queued.pop(0)
            self._asked[request.number] = request
            return request.number, request.names, request.ranks

    def answered(self, number: int, rank: Any, data: Any) -> None:
        with self._lock:
            request = self._asked.get(number)
            if request is None or not isinstance(rank, int):
                return
            request.answers[rank] = data
            if set(request.answers) >= set(request.ranks):
                del self._asked[number]
                request.settled.set()

    def refused(self, number: int) -> None:
        with self._lock:
            request = self._asked.pop(number, None)
        if request is not None:
            request.settled.set()

    def end(self) -> None:
        """The cell ended: no answer comes any more; what was asked gets what came."""
        with self._lock:
            self._ended = True
            waiting = [*self._queued, *self._asked.values()]
            self._queued, self._asked = [], {}
        for request in waiting:
            request.settled.set()


class Errand:
    """Work the notebook asks of a background run's group of processes (``%taas stacks``), done by the run's pump:
    no other thread may read the group's channel while the pump does."""

    def __init__(self, work: Callable[[Any], Any]) -> None:
        self.work = work
        self.value: Any = None
        self.error: BaseException | None = None
        self.ran = False
        self.settled = threading.Event()  # done, or the run ended first

    def run(self, group: Any) -> None:
        """In the pump: the work, over the run's group; what it raises is the notebook's, not the run's."""
        try:
            self.value = self.work(group)
            self.ran = True
        except Exception as e:
            self.error = e
        finally:
            self.settled.set()

    def wait(self) -> bool:
        """Until the pump did it, or the run ended first (False); its error raised here. An interrupt of the kernel
        ends the wait."""
        while not self.settled.wait(WAIT_SLICE_SECONDS):
            pass
        if self.error is not None:
            raise self.error
        return self.ran


class Errands:
    """The errands of a background run: asked by the notebook, taken by the run's pump one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[Errand] = []
        self._ended = False

    def ask(self, work: Callable[[Any], Any]) -> Errand:
        errand = Errand(work)
        with self._lock:
            if self._ended:
                errand.settled.set()
            else:
                self._queued.append(errand)
        return errand

    def take(self) -> Errand | None:
        with self._lock:
            return self._queued.pop(0) if self._queued else None

    def end(self) -> None:
        """The run ended: what is still asked settles undone."""
        with self._lock:
            self._ended = True
            waiting, self._queued = self._queued, []
        for errand in waiting:
            errand.settled.set()


class BackgroundRun:
    """A taas cell's run going on in the background: what the cell returns, and what ``%taas runs`` lists.

    ``done()``, ``wait(timeout)``, ``stop()``, ``result`` (the names that came back, or the run's failure raised).
    Its names join the notebook at the first moment between cells after it ended, or in ``wait()``.
    """

    def __init__(self, number: int, cell: str, what: str, on_cluster: bool = False) -> None:
        self.number = number
        self.cell = cell  # "In[5]": the cell whose output shows the run
        self.what = what  # "4 ranks on cpu"
        self.on_cluster = on_cluster  # its ranks run on the cluster's nodes: the connection must stay
        self.stops = StopRequests()
        self.pulls = PullRequests()  # a session cell's: `%taas pull` while it runs
        self.errands = Errands()  # a session cell's: `%taas stacks` while it runs
        self._began = time.monotonic()
        self._ended_at: float | None = None
        self._ended = threading.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._names: dict[str, Any] | None = None  # bound into the notebook; None until then
        self._take_back: Callable[[RunResult], dict[str, Any]] | None = None
        self._thread: threading.Thread | None = None

    # -- the run's side ---------------------------------------------------------------------------
    def start(self, work: Callable[[], RunResult], take_back: Callable[[RunResult], dict[str, Any]]) -> None:
        """Run ``work`` in a thread of its own whose output goes to this cell; ``take_back`` binds a result's
        names into the notebook (called between cells, in the kernel's main thread)."""
        self._take_back = take_back
        route = _to_this_cell()
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run,
            args=(self._run, work, route, sys.stderr),  # the cell's: another cell may swap sys.stderr meanwhile
            name=f"taas background run {self.number}",
            daemon=True,
        )
        self._thread.start()

    def _run(self, work: Callable[[], RunResult], route: Callable[[], None], stderr: Any) -> None:
        route()
        streams.pin_stderr(stderr)
        try:
            self._result = work()
        except BaseException as e:  # the run's failure, shown in its own cell and kept for .result
            self._error = e
            _show_failure(e, stderr)
        finally:
            self.pulls.end()
            self.errands.end()
            self._ended_at = time.monotonic()
            self._ended.set()

    # -- the notebook's side ----------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the run has ended, however it ended."""
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the run ends (at most ``timeout`` seconds), then bind its names; whether it ended. An
        interrupt of the kernel ends the wait, not the run."""
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            raise TaasUsageError(f"wait(timeout={timeout!r}) is not allowed: use a number of seconds >= 0, or None")
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended.is_set():
            left = WAIT_SLICE_SECONDS if deadline is None else min(WAIT_SLICE_SECONDS, deadline - time.monotonic())
            if left <= 0:
                return False
            self._ended.wait(left)
        self.bind()
        return True

    def stop(self) -> None:
        """Stop the run, as an interrupt of its cell would, and wait until it has ended; its names (if it had
        sent any) join the notebook."""
        if not self._ended.is_set():
            self.stops.ask()
            self.until_stopped()
        self.bind()

    def until_stopped(self) -> None:
        """Once a stop is asked: wait for the run's end, and ask again if it has not come in a while (a second
        stop stops the ranks at once, as a second interrupt does)."""
        if not self.wait(STOP_WAIT_SECONDS):
            self.stops.ask()
            self.wait(STOP_WAIT_SECONDS)

    @property
    def result(self) -> dict[str, Any]:
        """The names the run sent back (bound into the notebook too); the run's failure raised, if it failed."""
        if not self._ended.is_set():
            raise TaasUsageError(f"taas run {self.number} is still running: .wait() first, or .done() to ask")
        if self._error is not None:
            raise self._error
        self.bind()
        return dict(self._names or {})

    def bind(self) -> dict[str, Any] | None:
        """Once the run has ended well, its names join the notebook (once); the names bound now, or None."""
        if not self._ended.is_set() or self._result is None or self._names is not None or self._take_back is None:
            return None
        self._names = self._take_back(self._result)
        return self._names

    def state(self) -> str:
        """One line: which run, where it shows, since when it runs or how it ended."""
        now = self._ended_at if self._ended_at is not None else time.monotonic()
        seconds = f"{now - self._began:.0f} s"
        if not self._ended.is_set():
            how = f"running for {seconds}"
        elif self._error is not None and self.stops.asked_ever:
            how = f"stopped after {seconds}"
        elif self._error is not None:
            how = f"failed after {seconds}: {_one_line(self._error)}"
        elif self._names is None:
            how = f"ended after {seconds}; its names join the notebook before the next cell"
        else:
            how = f"ended after {seconds}; {_listed(self._names)} back in the notebook"
        return f"run {self.number} (cell {self.cell}, {self.what}): {how}"

    def __repr__(self) -> str:
        return f"<taas {self.state()}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(f"taas {self.state()}")

    def join(self, seconds: float) -> None:
        """The thread's end, at most ``seconds``."""
        if self._thread is not None:
            self._thread.join(seconds)


class BackgroundRuns:
    """The kernel's background runs: numbered as they start, bound between cells as they end, all stopped by
    ``%taas stop`` and at the kernel's shutdown."""

    def __init__(self) -> None:
        self.runs: list[BackgroundRun] = []
        self._count = 0

    def new(self, cell: str, what: str, on_cluster: bool = False) -> BackgroundRun:
        self._count += 1
        run = BackgroundRun(self._count, cell, what, on_cluster)
        self.runs.append(run)
        return run

    def running(self) -> list[BackgroundRun]:
        return [run for run in self.runs if not run.done()]

    def between_cells(self) -> None:
        """Before a cell runs: the runs that ended bind their names and are said in one line each, then forgotten
        (a handle kept in a name still answers)."""
        for run in [run for run in self.runs if run.done()]:
            self.runs.remove(run)
            run.bind()
            print(f"taas: {run.state()}", file=sys.stderr)

    def summary(self) -> str:
        """``%taas``'s line: how many runs are in the background."""
        running = len(self.running())
        if not self.runs:
            return "none (--background starts one)"
        ended = len(self.runs) - running
        return f"{running} running, {ended} ended and not yet said (%taas runs lists them)"

    def describe(self) -> str:
        """``%taas runs``: a line for each run in the background."""
        if not self.runs:
            return "taas: no run in the background (a taas cell with --background starts one)"
        return "\n".join(f"taas: {run.state()}" for run in self.runs)

    def wait_all(self) -> None:
        """``%taas wait``: until every background run has ended; their names join the notebook."""
        for run in list(self.runs):
            run.wait()
        self.between_cells()

    def stop_all(self) -> list[BackgroundRun]:
        """End every run in the background, each as an interrupt would, then at once; the runs that were
        running, forgotten (the caller says what became of them)."""
        running = self.running()
        for run in running:  # all asked first: they stop together
            run.stops.ask()
        for run in running:
            run.until_stopped()
            self.runs.remove(run)
        return running


def _to_this_cell() -> Callable[[], None]:
    """What makes another thread's output, displays and errors go to the cell running now: ipykernel 7 sends a
    thread's messages to the cell its ``set_thread_parent`` names (ipykernel 6 sends them to the cell that runs
    when they are written, and nothing better can be done there)."""
    from IPython.core.getipython import get_ipython

    shell = get_ipython()
    parent = getattr(shell, "parent_header", None)
    outputs: list[Any] = [sys.stdout, sys.stderr, getattr(shell, "display_pub", None), shell]
    setters = [getattr(target, "set_thread_parent", None) for target in outputs]

    def route() -> None:
        for set_parent in setters:
            if parent and callable(set_parent):
                set_parent(parent)

    return route


def _show_failure(error: BaseException, stderr: Any) -> None:
    """A background run's failure, in its own cell's output (``stderr``), as IPython would have shown it there."""
    render = getattr(error, "_render_traceback_", None)
    try:
        lines = render() if callable(render) else traceback.format_exception_only(type(error), error)
    except Exception:
        lines = traceback.format_exception_only(type(error), error)
    stderr.write("\n".join(line.rstrip("\n") for line in lines) + "\n")
    stderr.flush()


def _listed(names: dict[str, Any]) -> str:
    if not names:
        return "no names"
    shown = ", ".join(list(names)[:8])
    return shown + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"
