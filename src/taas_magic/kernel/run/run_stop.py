"""A stop of a run under way: why it stops, and its escalating signals, each sent once it is due.

The run state machine (``run_state.py``) begins a stop on a failure, when every rank is done, at
``--timeout`` or on an interrupt, with the steps its ``Policy`` gives for that cause (``run_result.py``);
the stop says which signals are due as the clock moves, and a second interrupt takes the next step now.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from taas_magic.kernel.run.run_result import Step


class StopCause(Enum):
    FAILURE = "failure"  # a process failed on its own
    FINISHED = "finished"  # every rank is done: only the producers run, and their work is over
    TIMEOUT = "timeout"  # --timeout elapsed
    INTERRUPT = "interrupt"  # the user interrupted the cell, or quit a rank's debugger


@dataclass
class Stop:
    """A stop under way since ``started``, for ``cause``: the signals of its ``steps`` (delay, signal) sent so far,
    the last of them at ``last_sent``."""

    cause: StopCause
    steps: tuple[Step, ...]
    started: float
    sent: int = 0
    last_sent: float = 0.0

    def due(self, now: float) -> list[int]:
        due = [signum for delay, signum in self.steps[self.sent :] if now - self.started >= delay]
        self.sent += len(due)
        self.last_sent = now if due else self.last_sent
        return due

    def skip_ahead(self, now: float) -> list[int]:
        """An impatient second interrupt: the next step now."""
        if self.sent >= len(self.steps):
            return []
        self.sent += 1
        self.last_sent = now
        return [self.steps[self.sent - 1][1]]

    def all_sent_before(self, now: float, seconds: float) -> bool:
        """Every signal went, the last more than ``seconds`` ago: what it asked of the processes is overdue."""
        return self.sent == len(self.steps) and now - self.last_sent > seconds

    def signals_sent(self) -> set[int]:
        """The signals sent so far: a process that died of one of them was stopped, not failing on its own."""
        return {signum for _, signum in self.steps[: self.sent]}
