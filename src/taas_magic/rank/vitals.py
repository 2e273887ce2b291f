"""In a rank: what its process holds (memory, and on CUDA its GPU's memory and load) and what its cell
is doing (``activity``), reported about once a second.

The cell's live view shows it in the rank's row, and its summary the peak: the process's high-water
mark as the kernel counts it (``ru_maxrss``), read once more as the cell ends, so a cell shorter than
a sampling interval, or memory held for less than one, is not missed. A thread samples,
so a rank busy in native code (a long matmul, a collective) is still seen. Sampling reads
``/proc/self/statm`` and, on CUDA, NVML through torch (``nvidia-ml-py``): neither initializes
CUDA, so a rank that has not touched its GPU yet is not made to.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import resource
import select
import sys
import threading
import time
from typing import Callable, Iterator

from taas_magic.process import kernel_debugger
from taas_magic.process.child import write_all
from taas_magic.rank import activity
from taas_magic.wire import records
from taas_magic.wire.records import RankActivity, RankVitals

INTERVAL = 1.0  # seconds between two samples, on average
# Each interval is drawn from 0.75-1.25 of it: samples at fixed instants would see a loop whose period divides
# a second at one phase only, and the shares of time drawn from them (kernel/view/time_shares.py) would be biased.
_JITTER = random.Random()  # taas's own: the cell's random numbers are the user's
_PAGE = os.sysconf("SC_PAGE_SIZE")


_send: Callable[[RankVitals | RankActivity], None] | None = None
_sample: "_Sampler | None" = None
_track = True  # sample the cell's activity too (rank.activity), for the hang watchdog
_in_cell = threading.Event()
_asked: int | None = None  # read end of the pipe on which the supervisor asks for the rank's stacks
_stack_fd = -1  # where they go
_asked_pipe = 0  # the ask pipe's inode: its descriptor's number may be another file's once the cell closed it


def attach(
    send: Callable[[RankVitals | RankActivity], None],
    gpu: int | None,
    track: bool = True,
    asked: int | None = None,
    stack_fd: int = -1,
) -> None:
    """In a rank, as it starts: where its samples go, and its CUDA device index (None on CPU); ``asked``: where
    the supervisor asks for the rank's stacks, which are written to ``stack_fd`` with its position.

    Samples are taken only while a cell runs (``sampling``): a session's ranks waiting for their
    next cell send nothing, so nothing piles up where no one reads it. Stacks are answered at any time.
    """
    global _send, _sample, _track, _asked, _stack_fd, _asked_pipe
    _send, _sample, _track, _asked, _stack_fd = send, _Sampler(gpu), track, asked, stack_fd
    _asked_pipe = os.fstat(asked).st_ino if asked is not None else 0
    kernel_debugger.hidden_thread(_every_interval, name="taas-vitals")


@contextlib.contextmanager
def sampling() -> Iterator[None]:
    """Around a cell: a sample at once (the row shows the rank running), then one about every ``INTERVAL``."""
    if _send is None:
        yield
        return
    _report()
    _in_cell.set()
    try:
        yield
    finally:
        _in_cell.clear()
        _report(track=False)  # the cell's last figures: its peak, even if it ended before the first interval


def _every_interval() -> None:
    while _send is not None:
        if _asked is None:
            _in_cell.wait()
            time.sleep(INTERVAL * _JITTER.uniform(0.75, 1.25))
        elif _asked_meanwhile(INTERVAL * _JITTER.uniform(0.75, 1.25)):
            _answer_stack_request()
            continue
        if _in_cell.is_set():
            _report()


def _asked_meanwhile(seconds: float) -> bool:
    """Whether the supervisor asks for the stacks within ``seconds``. A cell that closed the pipe's descriptor
    (``os.closerange``), or whose own file took its number since, leaves the rank to faulthandler's signal, which
    the supervisor falls back on: what is read here is never the cell's."""
    global _asked
    assert _asked is not None
    try:
        ready = bool(select.select([_asked], [], [], seconds)[0])
        if ready and os.fstat(_asked).st_ino != _asked_pipe:
            raise OSError("the ask pipe's descriptor is another file now")
        return ready
    except (OSError, ValueError):
        _asked = None
        return False


def _answer_stack_request() -> None:
    """The rank's stacks, each thread's, preceded by the position of its collectives at the same moment.

    Taken here, by a thread of the rank, rather than by faulthandler's signal handler (which the supervisor
    falls back on when no answer comes: a main thread that holds the interpreter in native code keeps this
    thread from running): a signal handler cannot read torch's flight recorder, and a periodic sample is up
    to a second older than the stacks.
    """
    global _asked
    assert _asked is not None
    try:
        if not os.read(_asked, 4096):  # every request waiting: one answer serves them all
            _asked = None  # the supervisor is gone: nobody asks any more
            return
    except OSError:
        _asked = None
        return
    line = b""
    if _track:
        try:
            line = records.position_line(activity.sample(whole=True))
        except Exception:  # the stacks matter more than the position: they go without it
            line = b""
    try:
        write_all(_stack_fd, line)
        faulthandler.dump_traceback(_stack_fd, all_threads=True)
    except OSError:
        _asked = None  # the supervisor's end is closed: the run is over


def _report(track: bool = True) -> None:
    global _send
    if _send is None or _sample is None:
        return
    try:
        _send(_sample())
        if _track and track:
            _send(activity.sample())
    except OSError:
        _send = None  # the report pipe is gone: the run is over


class _Sampler:
    def __init__(self, gpu: int | None):
        self.gpu = gpu
        self.peak = 0

    def __call__(self) -> RankVitals:
        memory = _resident_bytes()
        self.peak = max(self.peak, memory, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        gpu_memory, utilization = self._gpu()
        return RankVitals(time.monotonic(), memory, self.peak, gpu_memory, utilization)

    def _gpu(self) -> tuple[int | None, int | None]:
        torch = sys.modules.get("torch")
        if self.gpu is None or torch is None:
            return None, None
        try:
            return int(torch.cuda.device_memory_used(self.gpu)), int(torch.cuda.utilization(self.gpu))
        except Exception:  # no NVML binding or driver: the row shows no GPU figures
            self.gpu = None
            return None, None


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except OSError:  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
