"""In a rank of a ``--profile`` run: torch.profiler around the cell, its trace written where the kernel merges it.

CPU activities always, CUDA ones on a GPU run; no stacks, no shapes, no memory: a trace a few megabytes a
second at most, which Perfetto opens. The trace is written whatever ended the cell (a failure is worth a
look too), taas's SIGTERM included (``--timeout``, another rank's failure, an interrupt's second step):
the rank writes its trace, then ends as the signal says. A rank killed before it could write (SIGKILL,
or SIGTERM while it waits inside a collective, where Python runs no handler) leaves none, and the
merged trace has no row for it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import tempfile
from typing import Any, Iterator

TRACE_NAME = "rank-{rank}.json"  # in the run's profile folder (kernel/running/profiling.py)
TRACE_FILE = re.compile(re.escape(TRACE_NAME).replace(re.escape("{rank}"), "([0-9]+)"))  # a trace's name, whole


@contextlib.contextmanager
def profiled(folder: str | None, device: str) -> Iterator[None]:
    """Around a cell's code: profile it when ``folder`` is given (the run asked for ``--profile``)."""
    if folder is None:
        yield
        return
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own log lines stay out of the cell's output
    # torch.profiler.profile wraps this one, and its start imports torch._inductor (2 s of CPU a rank, 9 s on a
    # busy machine) to ask a question about CUDA graphs; this one starts at once and writes the same trace.
    from torch.autograd.profiler import profile

    trace = os.path.join(folder, TRACE_NAME.format(rank=int(os.environ.get("RANK", "0"))))
    profiler = profile(use_device="cuda" if device == "cuda" else None, use_kineto=True)
    running = contextlib.ExitStack()  # the profiler, once it runs: closing it stops it (once)
    written: list[bool] = []

    def write() -> None:
        if not written:
            written.append(True)
            with contextlib.suppress(Exception):  # a profiler stopped while it started: no trace, nothing raised
                running.close()
                profiler.export_chrome_trace(trace + ".part")
                os.replace(trace + ".part", trace)  # whole or absent: a cluster's agent sends it on as it appears

    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: a handler set outside Python
    # Before the profiler starts: a SIGTERM that comes while it starts is handled once it has started, and the
    # (short) trace is written; one that comes before that finds no profiler, and the rank leaves no trace.
    signal.signal(signal.SIGTERM, _written_first(write, previous))
    try:
        with _stderr_without(_KINETO_THREAD_COMPLAINT):
            running.enter_context(profiler)
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        write()


# Kineto prints this as the profiler starts in a thread other than the one where torch registered its client:
# in a process forked from a thread of the kernel's, or of the fork server's, whichever thread imported torch.
# The trace is the same; the line would only alarm (it names two thread numbers and says ERROR).
_KINETO_THREAD_COMPLAINT = re.compile(rb"^ERROR: External init callback must run in same thread as registerClient")


@contextlib.contextmanager
def _stderr_without(unwanted: re.Pattern[bytes]) -> Iterator[None]:
    """While the block runs, what is written to descriptor 2 (by C++ too) is held in a temporary file; then it
    is written to descriptor 2 as it came, less the lines ``unwanted`` matches. A file, not a pipe: another
    thread of the rank that writes much meanwhile never blocks."""
    held = tempfile.TemporaryFile()
    saved = os.dup(2)
    try:
        os.dup2(held.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        kept = b"".join(line for line in held.read().splitlines(keepends=True) if not unwanted.match(line))
        held.close()
        if kept:
            os.write(2, kept)


def _written_first(write: Any, previous: Any) -> Any:
    """A SIGTERM handler: the trace written, then the signal taken as before (the default ends the rank)."""

    def handler(signum: int, frame: Any) -> None:
        write()
        signal.signal(signal.SIGTERM, previous)
        os.kill(os.getpid(), signal.SIGTERM)

    return handler
