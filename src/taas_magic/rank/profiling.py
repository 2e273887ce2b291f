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
from typing import Any, Iterator

TRACE_NAME = "rank-{rank}.json"  # in the run's profile folder (kernel/profiling.py)
TRACE_FILE = re.compile(re.escape(TRACE_NAME).replace(re.escape("{rank}"), "([0-9]+)"))  # a trace's name, whole


@contextlib.contextmanager
def profiled(folder: str | None, device: str) -> Iterator[None]:
    """Around a cell's code: profile it when ``folder`` is given (the run asked for ``--profile``)."""
    if folder is None:
        yield
        return
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own log lines stay out of the cell's output
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trace = os.path.join(folder, TRACE_NAME.format(rank=int(os.environ.get("RANK", "0"))))
    # One cycle, kept whole: acc_events also spares the cell torch's warning about cycles (2.11 and later)
    profiler = profile(
        activities=activities, record_shapes=False, with_stack=False, profile_memory=False, acc_events=True
    )
    started: list[bool] = []
    written: list[bool] = []

    def write() -> None:
        if started and not written:
            written.append(True)
            with contextlib.suppress(Exception):  # a profiler stopped while it started: no trace, nothing raised
                profiler.stop()
                profiler.export_chrome_trace(trace + ".part")
                os.replace(trace + ".part", trace)  # whole or absent: a cluster's agent sends it on as it appears

    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: a handler set outside Python
    # Before the profiler starts, which takes a while on a busy machine: a SIGTERM meanwhile is handled as
    # soon as Python runs again, and the trace (short) is written all the same.
    signal.signal(signal.SIGTERM, _written_first(write, previous))
    try:
        started.append(True)
        profiler.start()
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        write()


def _written_first(write: Any, previous: Any) -> Any:
    """A SIGTERM handler: the trace written, then the signal taken as before (the default ends the rank)."""

    def handler(signum: int, frame: Any) -> None:
        write()
        signal.signal(signal.SIGTERM, previous)
        os.kill(os.getpid(), signal.SIGTERM)

    return handler
