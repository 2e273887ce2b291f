"""A session cell's interrupt, taken by every rank just before the same optimizer step.

An interrupt that lands wherever each rank happens to be leaves DDP's replicas different: one rank has
applied one more ``optimizer.step()`` than another, or stopped inside one, and the next cell trains on
with models that are no longer copies of each other. So when the user interrupts a session's cell, or
its ``--timeout`` runs out, the ranks are first sent ``STOP_TOGETHER`` (``kernel/run/run_result.py``'s
``SESSION`` policy), not SIGINT:

- a rank whose cell has not begun an optimizer step raises ``KeyboardInterrupt`` at once, as at SIGINT
  (a cell that does not train is interrupted at once);
- one that has goes on to its next step. There the ranks agree on the step every rank stops before: the
  first to get there proposes one a little ahead (``MARGIN_SECONDS`` of its steps, at least the next) in
  the run's store, and the first proposal is every rank's answer (``compare_set``). DDP keeps its ranks
  within a step of each other, and the signal reaches each within far less than the margin, so none has
  begun that step yet; each raises ``KeyboardInterrupt`` just before it, the same steps applied as the others.

SIGINT follows a moment later for ranks that do not get there (a cell that stopped stepping, ranks that
do not step together): they stop where they are, as before. Each rank's report says how many steps its
cell applied and whether it stopped inside one (``Failed.steps``), and the kernel says whether they agree.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from types import FrameType
from typing import Any, Callable, Iterator

from taas_magic.process.child import as_an_interrupt
from taas_magic.rank import pulling, run_store
from taas_magic.rank.pulling import PullRequest
from taas_magic.wire.rank_control import PULL_TOGETHER, STOP_TOGETHER

# How far ahead of the first rank to get the signal the ranks stop: the signal reaches the others later (the
# supervisor signals one rank after another; on a cluster, each node's in turn), and a rank that passed the step
# before it knew would wait for ever for the others in its next collective.
MARGIN_SECONDS = 0.25


class StepStops:
    """A session rank's optimizer steps in the running cell, and the interrupt that waits for the next one."""

    def __init__(self) -> None:
        self.cell: int | None = None  # the number of the cell whose code runs (``SessionCell.number``)
        self.begun = 0  # optimizer steps the cell began in this rank
        self.applied = 0  # and those that ended
        self.first_step_at = 0.0  # when the cell began its first step
        self.asked = False  # STOP_TOGETHER came: stop before the agreed step
        self.stop_before: int | None = None  # the agreed step
        self.stopped_there = False  # the cell's KeyboardInterrupt came at the agreed step: no peer waits for it
        self.pull_asked = False  # PULL_TOGETHER came: answer the request before the agreed step
        self.pull: PullRequest | None = None  # the request, read at the first step after it came
        self.pull_before: int | None = None
        self.last_pull = 0  # the number of the last pull read (across cells: pulls are numbered across the kernel)
        self.answer_pull: Callable[[PullRequest], None] = lambda asked: None  # the session's: sends the names
        self.hooks: list[Any] = []
        self.before: Any = signal.SIG_DFL  # the handler ``install`` replaced
        self.before_pull: Any = signal.SIG_IGN

    def install(self) -> None:
        """For the session's life: the signal, and hooks around every optimizer's step (torch's global ones)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.hooks = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]
        self.before = signal.signal(STOP_TOGETHER, self._on_signal)
        self.before_pull = signal.signal(PULL_TOGETHER, self._on_pull)

    def uninstall(self) -> None:
        for hook in self.hooks:
            hook.remove()
        signal.signal(STOP_TOGETHER, self.before)
        signal.signal(PULL_TOGETHER, self.before_pull)

    @contextlib.contextmanager
    def running(self, cell: int) -> Iterator[None]:
        """Around a cell's run: its steps counted from 0, an interrupt of it taken at a step."""
        self.cell, self.begun, self.applied, self.asked, self.stop_before = cell, 0, 0, False, None
        self.stopped_there, self.pull_asked, self.pull, self.pull_before = False, False, None, None
        try:
            yield
        finally:
            self.cell = None

    def progress(self) -> tuple[int, bool] | None:
        """The steps the cell applied, and whether it stopped inside one; None when it began none."""
        if self.begun == 0:
            return None
        return self.applied, self.begun > self.applied

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.cell is None or self.begun == 0:  # no step to stop at: an interrupt, held or dropped as one is
            as_an_interrupt(signum, frame)
        else:
            self.asked = True

    def _on_pull(self, signum: int, frame: FrameType | None) -> None:
        """A pull while the cell runs: at the agreed step; at once in a cell that has begun none (nothing is
        in the middle of a step then)."""
        if self.cell is None:
            return  # between cells: the kernel pulls with a cell of its own
        if self.begun > 0:
            self.pull_asked, self.pull_before = True, None  # read at the next step, outside the handler
            return
        asked = self._read_pull()
        if asked is not None:
            self.answer_pull(asked)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.cell is None:
            return
        self.begun += 1
        if self.begun == 1:
            self.first_step_at = time.monotonic()
        if self.pull_asked and not self.asked:
            self._pull_here()
        if not self.asked:
            return
        if self.stop_before is None:
            self.stop_before = self._agree(f"taas/stop-before/{self.cell}", self.begun + self._margin())
        if self.begun >= self.stop_before:
            self.begun -= 1  # this one does not begin
            self.stopped_there = True
            raise KeyboardInterrupt

    def _pull_here(self) -> None:
        """Answer the pull if this is the step the ranks agreed on (the values as they are after the steps before
        it, in every rank alike), then let the step begin."""
        if self.pull is None or self.pull_before is None:
            self.pull = self._read_pull()
        if self.pull is None:
            self.pull_asked = False
            return
        if self.pull_before is None:
            self.pull_before = self._agree(f"taas/pull-before/{self.pull.number}", self.begun + self._margin())
        if self.begun >= self.pull_before:
            asked, self.pull, self.pull_before, self.pull_asked = self.pull, None, None, False
            self.answer_pull(asked)

    def _read_pull(self) -> PullRequest | None:
        asked = pulling.request(after=self.last_pull)
        if asked is not None:
            self.last_pull = asked.number
        return asked

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.cell is not None:
            self.applied += 1

    def _margin(self) -> int:
        """``MARGIN_SECONDS`` in this cell's steps, at least one."""
        if self.begun < 2:
            return 1
        step_seconds = (time.monotonic() - self.first_step_at) / (self.begun - 1)
        return max(1, math.ceil(MARGIN_SECONDS / max(step_seconds, 1e-6)))

    def _agree(self, key: str, proposed: int) -> int:
        """The step every rank of the cell stops (or answers a pull) before: the first proposal under ``key`` in the
        run's store. Without the store, this rank does it here (its report says where, and the kernel whether the
        others did too)."""
        try:
            return int(run_store.client().compare_set(key, "", str(proposed)))
        except Exception:
            return self.begun
