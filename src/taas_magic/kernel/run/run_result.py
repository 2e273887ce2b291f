"""How a run is steered and how it ended: the two policies of the run state machine (one-shot cells and
session cells) and the frozen ``RunResult`` that ``render`` words every message from.

``run_state.py`` is the machine that applies a policy to a run's events and hands back its result.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from taas_magic.kernel.diagnosis.hang import Process
from taas_magic.wire.events import Key
from taas_magic.wire.rank_control import STOP_TOGETHER
from taas_magic.wire.records import CellEnded, Failed, SavedOnNode

Step = tuple[float, int]  # (seconds after the stop began, signal to send)


class Outcome(Enum):
    """How a run ended; the value is the live view's word for it."""

    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    INTERRUPTED = "interrupted"
    SESSION_ENDED = "session ended"
    LOST = "lost"  # taas lost the run's processes (a node, the fork server, a supervisor): no result says more


class EndCause(Enum):
    """Why a session cannot go on."""

    RANK_EXITED = "rank exited"  # its process group cannot continue
    PRODUCER_DIED = "producer died"  # its loader's ranks would wait for elements that never come
    STUCK = "stuck"  # ranks did not leave an interrupted cell in time
    INTERRUPTED_TWICE = "interrupted twice"  # the user would not wait for the ranks to leave the cell


class Notice(Enum):
    """A kind of thing taas did on the user's behalf, said in a line after the cell."""

    SAVED_ON_NODE = "saved on node"
    SAVE_SKIPPED = "save skipped"
    DELIVERY = "delivery"


@dataclass(frozen=True)
class Policy:
    """How a run is steered and worded: the one-shot cell and the session cell differ here alone."""

    keep: bool  # the ranks outlive the cell: it is over once each said how it ended there; an exit ends the session
    on_failure: tuple[Step, ...]  # the signals when a process failed or the ranks are done
    on_interrupt: tuple[Step, ...]  # the signals when the user interrupted the cell or quit a debugger
    on_timeout: tuple[Step, ...]  # the signals when --timeout ran out
    again_ends: bool  # an interrupt once the last signal went ends the session (else, and before: the next one now)
    interrupt_at_once: bool  # an interrupt's first signal goes out at once (else: with the next tick)
    leave_seconds: float | None  # ranks still in an interrupted cell this long after the last signal end the session
    own_interrupt_stops: bool  # a KeyboardInterrupt a cell raised itself stops the other processes
    pauses: bool  # --debug keeps the first rank that raised, paused at its error
    order: tuple[Outcome, ...]  # which outcome the cell reports when several happened, the first that did
    notices: tuple[Notice, ...]  # the notices said after the cell
    others_were: str  # what became of the other ranks after a failure, as its message says it
    timeout_end: str  # how the message of --timeout ends


STOP_SECONDS = 2.0  # a session's ranks have this long to stop at a step together before they are interrupted
RELEASE_SECONDS = 0.5  # a session rank released from its collective by a failed peer has this long to say so

ONE_SHOT = Policy(
    keep=False,
    on_failure=((0.0, signal.SIGTERM), (3.0, signal.SIGKILL)),
    # SIGINT first, so that `finally` blocks and Lightning's shutdown run.
    on_interrupt=((0.0, signal.SIGINT), (3.0, signal.SIGTERM), (6.0, signal.SIGKILL)),
    on_timeout=((0.0, signal.SIGTERM), (3.0, signal.SIGKILL)),
    again_ends=False,
    interrupt_at_once=False,
    leave_seconds=None,
    own_interrupt_stops=True,
    pauses=True,
    order=(Outcome.INTERRUPTED, Outcome.TIMED_OUT, Outcome.FAILED),
    notices=(Notice.SAVED_ON_NODE, Notice.SAVE_SKIPPED, Notice.DELIVERY),
    others_were="stopped",
    timeout_end="now stopped",
)
SESSION = Policy(
    keep=True,
    # Those waiting for the failed rank in a collective leave it at once as it cuts its connections
    # (rank/group_links.py), and report where they were; those at work elsewhere are interrupted.
    on_failure=((RELEASE_SECONDS, signal.SIGINT),),
    # The ranks stop before the same optimizer step, the replicas equal; those that do not get there in time stop
    # where they are (rank/stopping.py).
    on_interrupt=((0.0, STOP_TOGETHER), (STOP_SECONDS, signal.SIGINT)),
    on_timeout=((0.0, STOP_TOGETHER), (STOP_SECONDS, signal.SIGINT)),
    again_ends=True,
    interrupt_at_once=True,
    leave_seconds=5.0,
    own_interrupt_stops=False,
    pauses=False,
    order=(Outcome.FAILED, Outcome.TIMED_OUT, Outcome.INTERRUPTED),
    notices=(Notice.DELIVERY,),
    others_were="interrupted by taas",
    timeout_end="now interrupted; the session goes on",
)


@dataclass(frozen=True)
class Failure:
    """A process that failed on its own: its cell raised (``raised``), or it died or exited non-zero (``code``)."""

    rank: Key
    time: float
    details: tuple[str, ...]  # traceback lines, or the last stderr lines of a crash
    where: str = ""  # what the process was doing: "at element 5 of pass 0 (samples …)"
    hint: str = ""  # advice for a mistake the rank recognized: "this run is on CPU …"
    raised: tuple[str, str] | None = None  # (exception type, message)
    code: int = 0  # the exit status of a process that ended without a record
    interrupted: bool = False  # what it raised was a KeyboardInterrupt
    peer_lost: bool = False  # what it raised says another process of the run went away


@dataclass(frozen=True)
class SessionEnd:
    """Why a session ended, with what its message shows."""

    cause: EndCause
    keys: tuple[Key, ...] = ()  # the process that exited, or those that did not leave the cell
    code: int = 0  # the exit status of the process that exited
    tail: tuple[str, ...] = ()  # the last lines it wrote to stderr, when it did not exit with 0
    stacks: Mapping[Key, str] = field(default_factory=dict)  # where the ranks that did not leave were


@dataclass(frozen=True)
class RunResult:
    """How a run ended: everything its messages are rendered from."""

    policy: Policy
    outcome: Outcome
    failures: tuple[Failure, ...]  # the processes that failed on their own, the first (the root cause) first
    broken: tuple[Failure, ...]  # those whose error only says a process of ``failures`` went away: not their own
    results: Mapping[int, Any]  # each sending rank's pickled names (rank 0's unless --from said others)
    skipped: Mapping[int, Mapping[str, str]]  # each sending rank's names that could not be sent back, and why
    records: Mapping[Key, CellEnded | Failed]  # how each process's cell ended
    exits: Mapping[Key, int]  # the exit status of each process that exited
    stopped: frozenset[Key]  # the processes taas stopped (or interrupted) before they failed on their own
    quit: frozenset[Key]  # the ranks whose debugger the user quit
    late: Mapping[Key, str] | None  # when --timeout elapsed: each process still at work, and where it was
    interrupted: bool  # the user interrupted the cell (or quit a debugger)
    saves_skipped: Mapping[str, frozenset[Key]]  # path -> the ranks whose torch.save was skipped
    saved_on_nodes: tuple[SavedOnNode, ...]  # rank 0's saves that stay on a cluster node
    end: SessionEnd | None  # why the session ended, if it did
    labels: Mapping[Key, str]  # names of the processes that are not ranks: "producer 0 of train_loader"
    timeout: float | None  # the --timeout, in seconds
    where: tuple[Process, ...] = ()  # where the processes were when the time ran out, or when taas stopped them
    ranks_per_node: int = 0  # > 0 on a cluster: where they were is grouped with their node

    @property
    def seen_as(self) -> Outcome:
        """How the ranks' work ended, as the live view's summary says it: an interrupt first, then the
        time, then a failure (a session cell reports a failure first, its view an interrupt); a session
        that ended for none of these says so."""
        seen = first_outcome(ONE_SHOT.order, self.interrupted, self.late is not None, bool(self.failures))
        return Outcome.SESSION_ENDED if seen is Outcome.DONE and self.end is not None else seen


def first_outcome(order: tuple[Outcome, ...], interrupted: bool, timed_out: bool, failed: bool) -> Outcome:
    """The first outcome of ``order`` that happened; done if none did."""
    happened = {Outcome.INTERRUPTED: interrupted, Outcome.TIMED_OUT: timed_out, Outcome.FAILED: failed}
    return next((outcome for outcome in order if happened.get(outcome)), Outcome.DONE)


def quit_debugger(record: CellEnded | Failed) -> bool:
    """The user quit a ``breakpoint()``'s debugger (``q``, or an interrupt at its prompt): pdb raised BdbQuit."""
    return isinstance(record, Failed) and record.ename == "BdbQuit"
