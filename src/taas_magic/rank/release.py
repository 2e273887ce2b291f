"""A session rank that an interrupt finds waiting in a collective: released by a thread of its own.

An interrupt is raised in a rank's code only when its main thread runs Python again. One waiting in gloo for a
peer that will never come (a peer not in the cell, or waiting in another collective) never does, and 5 s later
the kernel would end the session. Python's own signal handler, in C, writes each signal's number to a "wakeup"
descriptor the moment it comes, whatever the main thread is doing: a thread reading it sees the interrupt, and if
the rank is still in the same cell a moment later (``GRACE_SECONDS``), it cuts the rank's process-group
connections (``group_links.py``). The collective fails, the interrupt is raised as it returns, the cut releases
the peers, and the kernel connects the group anew: the session goes on.

A rank whose main thread runs Python takes the interrupt at once and is out of the cell long before the grace
ends: nothing is cut. Between cells the rank ignores SIGINT, and an ignored signal is not written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator

from taas_magic.process import kernel_debugger
from taas_magic.rank.group_links import GroupLinks

GRACE_SECONDS = 1.0  # the kernel gives a rank 5 s to leave an interrupted cell


class Release:
    """Cuts ``links`` when an interrupt leaves the rank in the cell it came in for longer than the grace."""

    def __init__(self, links: GroupLinks) -> None:
        self.links = links
        self.cell = 0  # the count of cells begun while one runs; 0 between cells
        self.begun = 0
        self.lock = threading.Lock()

    def install(self) -> None:
        """For the session's life, from its main thread: the wakeup descriptor, and the thread that reads it."""
        read, write = os.pipe()
        os.set_blocking(write, False)  # the signal handler never waits for the reader
        try:
            signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no release, the kernel's 5 s still hold
            os.close(read)
            os.close(write)
            return
        os.register_at_fork(after_in_child=_forget_in_child)
        kernel_debugger.hidden_thread(self._watch, read, name="taas-release")

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Around a cell's code: an interrupt that finds it still running after the grace releases the rank."""
        with self.lock:
            self.begun += 1
            self.cell = self.begun
        try:
            yield
        finally:
            with self.lock:
                self.cell = 0

    def _watch(self, read: int) -> None:
        while True:
            try:
                signals = os.read(read, 64)
            except OSError:
                return
            if not signals:
                return
            with self.lock:
                cell = self.cell
            if signal.SIGINT in signals and cell:
                time.sleep(GRACE_SECONDS)
                with self.lock:
                    if self.cell == cell:
                        self.links.cut()


def _forget_in_child() -> None:
    """A process the rank forks (a DataLoader's worker) writes no signal to the rank's descriptor."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from another thread: it has no main thread to set it from
        pass
