"""What the run state machine (``run_state.py``) asks the pump (``controller.Pump``) to do: the actions
it answers events with, each a frozen value the pump carries out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

from taas_magic.kernel.diagnosis.hang import Hang
from taas_magic.wire.events import Key


@dataclass(frozen=True)
class Signal:
    signum: int
    keys: tuple[Key, ...] | None  # None: every process still running


class Why(Enum):
    """Why the stacks of some processes are taken."""

    LATE = "late"  # --timeout elapsed (the events that came meanwhile are taken first: one that ended is not late)
    STUCK = "stuck"  # a session's ranks did not leave an interrupted cell
    STOP = "stop"  # a failure or an interrupt is about to stop them: where were they?
    HANG = "hang"  # the watchdog: no process moved for --hang-after seconds


@dataclass(frozen=True)
class TakeStacks:
    """Take these processes' stacks and hand them to ``stacks_taken``."""

    keys: tuple[Key, ...]
    why: Why


@dataclass(frozen=True)
class ShowHang:
    """No process moved for ``hang.stalled`` seconds: say where each is and why, and let the run go on."""

    hang: Hang


@dataclass(frozen=True)
class ShowView:
    elapsed: float  # seconds since the run started


@dataclass(frozen=True)
class AskLine:
    """Ask the user for a line for ``key``'s debugger; tell ``waited`` how long it took."""

    key: Key
    prompt: str


@dataclass(frozen=True)
class Answer:
    """Answer ``key``'s debugger without asking: the run is being stopped."""

    key: Key
    line: str


@dataclass(frozen=True)
class MarkEnded:
    """The live view's row of ``key`` ends in ``state``: done, failed or stopped."""

    key: Key
    state: str


@dataclass(frozen=True)
class EndSession:
    """The session cannot go on: the cell ends with ``render.session_ended(result())``."""


Action = Union[Signal, TakeStacks, ShowHang, ShowView, AskLine, Answer, MarkEnded, EndSession]
