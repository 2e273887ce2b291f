"""One taas run from start to finish: start the ranks, pump their events, carry out what the run decides.

The decisions are ``run_state.RunState``'s and the words ``render``'s; this module does the I/O
around them: it reads a group's events, writes the ranks' output, draws the live view, asks the
user for the line a rank's debugger waits for, sends signals and takes stacks; and it starts a run
again for ``--max-restarts``. Every way out — success, a failing rank, a timeout, an interrupt, an
error of our own — passes through ``RankGroup.close``, so no process, pipe or port outlives the cell.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, assert_never

from taas_magic.errors import DeliveryLost, ForkServerDied, RunLost
from taas_magic.kernel.header.spec import LaunchSpec
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
from taas_magic.kernel.run.run_result import ONE_SHOT, Outcome, Policy, RunResult
from taas_magic.kernel.run.run_state import RunState
from taas_magic.kernel.running import environment
from taas_magic.kernel.view import render
from taas_magic.kernel.view.front_end import CellFrontEnd
from taas_magic.kernel.view.live_view import RunView
from taas_magic.kernel.view.streams import RankOutput
from taas_magic.launch.backend import Backend, Launch, PlanT, SessionGroup
from taas_magic.launch.rendezvous import new_run_id
from taas_magic.process import containment, logs
from taas_magic.wire.events import Event, Exited, InputRequest, Key, Output, Report, Result

POLL_SECONDS = 0.05
STACK_SECONDS = 2.0
LOST = (RunLost, ForkServerDied, DeliveryLost)  # the run's processes are gone: no result of theirs says more

log = logging.getLogger(__name__)


def run(
    spec: LaunchSpec,
    plan: PlanT,
    backend: Backend[PlanT],
    front: CellFrontEnd,
    kernel_environ: Mapping[str, str],
    labels: Mapping[Key, str] | None = None,
    keep_paused: Callable[[SessionGroup, int], None] | None = None,
) -> RunResult:
    """Run ``plan`` as the ranks of ``spec`` for the cell ``front`` stands for; return on success, raise what
    the cell should show otherwise. ``labels`` names the processes that are not ranks (data producers, keyed
    ``Producer``).

    With ``--debug``, the first rank whose cell raised stays, paused at its error, while the others
    are stopped; the group is handed to ``keep_paused`` instead of being closed.

    With ``--max-restarts N``, a run that failed because a rank did (not an interrupt, not
    ``--timeout``, which counts from the cell's start) is started again, up to N times, each time
    with a fresh run id and rendezvous and ``TORCHELASTIC_RESTART_COUNT`` one higher.
    """
    labels = dict(labels or {})
    deadline = None if spec.timeout is None else time.monotonic() + spec.timeout
    first_id = new_run_id()
    with logs.kernel_side(spec.log, first_id) as log_file:
        log.info("run %s: %d ranks on %s, %s", first_id, spec.world_size, spec.device, backend.name)
        try:
            for restart in range(spec.max_restarts + 1):
                launch = environment.launch(
                    spec,
                    first_id if restart == 0 else new_run_id(),
                    kernel_environ,
                    restart=restart,
                    elastic_id=first_id,
                )
                # A rank paused by --debug is kept from the last start alone: an earlier one's failure
                # starts the run again.
                last = restart == spec.max_restarts
                state = _attempt(spec, plan, backend, launch, front, labels, deadline, keep_paused if last else None)
                deadline = state.deadline  # later by the time a person spent at a debugger prompt
                result = state.result()
                if result.outcome is not Outcome.FAILED or restart == spec.max_restarts:
                    break
                front.write("stderr", render.restarting(result, restart + 1, spec.max_restarts))
            if spec.max_restarts and result.outcome is Outcome.FAILED:
                front.write("stderr", render.restarts_spent(spec.max_restarts))
        finally:
            if log_file is not None:
                front.write("stderr", f"taas: TAAS_LOG={spec.log}: this run's log is {log_file}\n")
    error = render.error(result, front.cell_names)
    if error is not None:
        raise error
    return result


def _attempt(
    spec: LaunchSpec,
    plan: PlanT,
    backend: Backend[PlanT],
    launch: Launch,
    front: CellFrontEnd,
    labels: dict[Key, str],
    deadline: float | None,
    keep_paused: Callable[[SessionGroup, int], None] | None,
) -> RunState:
    """One start of the run, pumped to its end; its state says how it went."""
    watched = watch(ONE_SHOT, spec, front, labels, deadline=deadline)
    state, output = watched.state, watched.output
    try:
        group = backend.start(plan, launch)
        try:
            pump = watched.pump(group)
            lost = False
            try:
                pump.until_over()
            except LOST:
                lost = True
                raise
            finally:
                pump.show_summary(lost)  # whatever ended the run: no view is left saying "running"
        finally:
            if state.paused and keep_paused is not None and group.running() == state.paused:
                keep_paused(group, min(state.paused))
            else:
                containment.close_whole(group.close)
    finally:
        output.finish()
        for line in render.notices(state.result()):
            front.write("stderr", line + "\n")
    return state


@dataclass(frozen=True)
class Watched:
    """A run's state machine, and where its output goes: what a pump needs besides the run's processes."""

    state: RunState
    output: RankOutput
    front: CellFrontEnd
    view: RunView | None

    def pump(self, group: SessionGroup) -> "Pump":
        return Pump(group, self.state, self.output, self.front, self.view)


def watch(
    policy: Policy,
    spec: LaunchSpec,
    front: CellFrontEnd,
    labels: Mapping[Key, str],
    ranks: list[int] | None = None,
    *,
    deadline: float | None = None,
    world: int = 0,
    heals: bool = False,
) -> Watched:
    """The one place a run's state and its output are made, for a one-shot run (``ranks`` None: every rank) or a
    session's cell (its ``ranks``, of the session's ``world``; ``heals``: a rank that dies is replaced), from the
    cell's options."""
    output, view = front.output(spec, list(range(spec.world_size)) if ranks is None else ranks, labels)
    state = RunState(
        policy,
        time.monotonic(),
        ranks=ranks or (),
        deadline=deadline,
        debug=spec.debug,
        timeout=spec.timeout,
        labels=labels,
        hang_after=spec.hang_after,
        ranks_per_node=spec.ranks_per_node if spec.nodes > 1 else 0,
        world=world,
        heals=heals,
    )
    return Watched(state, output, front, view)


class Pump:
    """Carries a group's events to its run state, and the state's actions to the group, the output,
    the live view and the user, until the run is over. One-shot cells and session cells alike: the
    state's policy makes the difference."""

    def __init__(
        self, group: SessionGroup, state: RunState, output: RankOutput, front: CellFrontEnd, view: RunView | None = None
    ):
        self.group = group
        self.state = state
        self.output = output
        self.front = front
        self.view = view if front.status is not None else None
        self.backlog: list[Event] = []  # events received and not taken yet
        self.stepped_at = time.monotonic()

    def until_over(self) -> None:
        """Step until the run is over. An interrupt may land anywhere in the loop, its test of whether the run is
        over included (found by twenty interrupts in a row on a busy machine): each is the cell's interrupt."""
        while True:
            try:
                if self.state.over(self.group.running()):
                    return
                if self.front.stop_asked():
                    self.interrupt()
                self._step()
            except KeyboardInterrupt:
                self.interrupt()

    def interrupt(self) -> None:
        """The user interrupted the cell. Another interrupt that lands while this one is taken (a person who
        presses twice) is taken after it: none leaves the cell as a bare KeyboardInterrupt."""
        while True:
            try:
                self._do(self.state.interrupt(time.monotonic(), self.group.running()))
                return
            except KeyboardInterrupt as e:
                if type(e) is not KeyboardInterrupt:
                    raise  # the cell's own end (RunInterrupted), not the user's signal

    def send_whole(self, send: Callable[[], None]) -> None:
        """Send a cell (``send``) to its ranks whole, even if the user interrupts meanwhile: the interrupt
        then interrupts the cell the ranks run.

        Sending a cell must be whole or not at all, and known to be which: an interrupt that landed
        just after the message went, and before the kernel noted it, would leave the ranks running a
        cell the kernel believes it never sent.
        """
        try:
            with containment.HeldInterrupts():
                send()
        except KeyboardInterrupt:
            self.interrupt()

    def show_summary(self, lost: bool = False) -> None:
        """The live view, once the run is over, whatever ended it: its summary, each row as the result says;
        ``lost``: taas lost the run's processes (``LOST``), and the run ends as lost, whatever its ranks had said.
        Called in ``finally``: a failure to draw it (the front end gone) must not hide why the run ended."""
        if self.view is None or self.front.status is None:
            return
        try:
            result = self.state.result()
            broken, failed = {f.rank: "stopped" for f in result.broken}, {f.rank: "failed" for f in result.failures}
            self.view.settle({**broken, **failed, **self._replaced(result)})
            outcome = Outcome.LOST if lost else result.seen_as
            self.front.status(self.view.summary(outcome.value, time.monotonic() - self.state.started), True)
            shown = self.view.picture() if self.front.picture is not None else None
            if self.front.picture is not None and shown is not None:
                self.front.picture(shown)
        except Exception:
            pass  # the cell's error says how the run ended; the view's last drawing stays

    def _replaced(self, result: RunResult) -> dict[Key, str]:
        """The rows of a session's ranks that died and that a new process replaces (``RunState.heals``), unless
        every rank died: nobody is left to heal them from."""
        died = [key for key, code in result.exits.items() if isinstance(key, int) and code != 0]
        if not self.state.heals or len(died) >= self.state.world:
            return {}
        return dict.fromkeys(died, "replaced")

    def _step(self) -> None:
        self._ask_pulls()
        self._run_errands()
        self._count_debugger_time()
        self._take_events(POLL_SECONDS)
        self.output.flush_idle()
        self._do(self.state.view(time.monotonic(), self.view is not None and self.view.changed))
        self._do(self.state.tick(time.monotonic(), self.group.running()))

    def _ask_pulls(self) -> None:
        """A `%taas pull` asked meanwhile goes to the ranks, which answer between two steps (``Result.pull``)."""
        pulls = self.front.pulls
        asked = pulls.take() if pulls is not None else None
        if pulls is not None and asked is not None and not self.group.ask_pull(*asked):
            pulls.refused(asked[0])

    def _run_errands(self) -> None:
        """What the notebook asked of the group meanwhile (``%taas stacks``), done here: only the pump reads it."""
        errand = self.front.errands.take() if self.front.errands is not None else None
        if errand is not None:
            errand.run(self.group)

    def _count_debugger_time(self) -> None:
        """Time a rank spends stopped in the notebook's visual debugger is a person's, as at a pdb prompt:
        it counts neither toward --timeout nor as a stall. Its row in the live view says ``paused``."""
        now = time.monotonic()
        stopped = self.front.stopped()
        if stopped:
            self.state.waited(now - self.stepped_at)
        self.stepped_at = now
        if self.view is not None:
            self.view.in_debugger(stopped)

    def _take_events(self, timeout: float) -> None:
        if not self.backlog:
            self.backlog = self.group.events(timeout)
        while self.backlog:  # an interrupt while one is taken leaves it to be taken again, never lost
            self._take(self.backlog[0])
            self.backlog.pop(0)

    def _take(self, event: Event) -> None:
        if isinstance(event, Output):
            self.output.feed(event.rank, event.stream, event.data)
            self.state.moved(time.monotonic())
        elif isinstance(event, Report):
            now = time.monotonic()
            if self.view is not None:
                self.view.take(
                    event.rank, event.record, now
                )  # progress, delivery counters and vitals are the view's alone
            self.state.reported(event.rank, event.record, now)
        elif isinstance(event, Result) and event.pull:
            if self.front.pulls is not None:
                self.front.pulls.answered(event.pull, event.rank, event.data)
        elif isinstance(event, Result):
            if isinstance(event.rank, int):  # always: producers send no names
                self.state.result_sent(event.rank, event.data)
        elif isinstance(event, Exited):
            if self.state.policy.keep:
                self.output.finish(event.rank)
            else:
                self.output.exited(event.rank)  # its last lines may still wait for the other ranks' same lines
            self._do(self.state.exited(event.rank, event.returncode, time.monotonic(), self.output.tail(event.rank)))
        elif isinstance(event, InputRequest):
            self.output.finish(event.rank)  # what it printed, whole, before its prompt
            self._do(self.state.input_requested(event.rank, event.prompt))
        else:
            assert_never(event)

    def _do(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Signal):
                self.group.signal(action.signum, action.keys)
            elif isinstance(action, TakeStacks):
                stacks = self.group.stacks(action.keys, STACK_SECONDS) if action.keys else {}
                if action.why is Why.LATE:
                    self._take_events(0)
                self._do(self.state.stacks_taken(action, stacks, time.monotonic(), self.group.running()))
            elif isinstance(action, ShowHang):
                self.output.flush_idle()
                self.front.write("stderr", "\n".join(render.hang(action.hang, self.front.cell_names)) + "\n")
            elif isinstance(action, ShowView):
                if self.view is not None and self.front.status is not None:
                    self.view.changed = False
                    self.front.status(self.view.render(action.elapsed), False)
            elif isinstance(action, AskLine):
                self._answer(action.key, self._ask(action.prompt))
            elif isinstance(action, Answer):
                self._answer(action.key, action.line)
            elif isinstance(action, MarkEnded):
                if self.view is not None:
                    self.view.ended(action.key, action.state)
            elif isinstance(action, EndSession):
                raise render.session_ended(self.state.result(), self.front.cell_names)
            else:
                assert_never(action)

    def _ask(self, prompt: str) -> str:
        """A line for a rank's debugger; "quit" on an interrupt, "continue" where none can be typed.

        The time a person takes to answer does not count toward ``--timeout``.
        """
        asked = time.monotonic()
        try:
            if self.front.read_line is None:
                raise EOFError
            return self.front.read_line(prompt)
        except KeyboardInterrupt:
            return "quit"  # the rank's breakpoint raises BdbQuit: the run then stops as on an interrupt
        except (EOFError, NotImplementedError, OSError):  # no input here (nbclient, a closed terminal): go on
            self.front.write("stderr", "taas: no input can be read here: the debugger continues\n")
            return "continue"
        finally:
            self.state.waited(time.monotonic() - asked)

    def _answer(self, key: Key, line: str) -> None:
        self.group.answer(key, line)
