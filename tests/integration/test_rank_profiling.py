"""A rank under --profile writes its trace whatever ends its cell, taas's SIGTERM included, and then ends as
the signal says; the rank's SIGTERM handling is as it was after the cell."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from taas_magic.rank.profiling import TRACE_NAME, profiled


def _cell_stopped_by_sigterm(folder: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a rank has it (process/child.py)
    os.environ["RANK"] = "3"
    import torch

    with profiled(folder, "cpu"):
        torch.ones(8) @ torch.ones(8)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler runs here, between two bytecodes of the cell
    os._exit(0)  # never reached: the signal ended the process


def _cell_that_ends(folder: str, handlers: multiprocessing.Queue) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["RANK"] = "0"
    with profiled(folder, "cpu"):
        pass
    handlers.put(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)


@pytest.fixture
def fork():
    return multiprocessing.get_context("fork")


def test_sigterm_during_a_profiled_cell_writes_the_trace_then_ends_the_rank(fork, tmp_path):
    rank = fork.Process(target=_cell_stopped_by_sigterm, args=(str(tmp_path),))
    rank.start()
    rank.join(60)
    assert rank.exitcode == -signal.SIGTERM
    trace = tmp_path / TRACE_NAME.format(rank=3)
    assert json.loads(trace.read_text())["traceEvents"], "the trace was written before the rank ended"


def test_after_a_profiled_cell_sigterm_is_handled_as_before(fork, tmp_path):
    handlers = fork.Queue()
    rank = fork.Process(target=_cell_that_ends, args=(str(tmp_path), handlers))
    rank.start()
    rank.join(60)
    assert rank.exitcode == 0 and handlers.get(timeout=5) is True
    assert (tmp_path / TRACE_NAME.format(rank=0)).exists()


def test_a_profiled_cell_starts_at_once_without_importing_torch_inductor(tmp_path):
    """torch.profiler.profile's start imports torch._inductor: 2 s of CPU in each rank (9 s on a busy machine,
    long enough for a --timeout to stop ranks that had not begun their cell)."""
    script = (
        "import os, sys, time, torch\n"
        "from taas_magic.rank.profiling import profiled\n"
        "began = time.process_time()\n"
        f"with profiled({str(tmp_path)!r}, 'cpu'):\n"
        "    started = time.process_time() - began\n"
        "    torch.ones(8) @ torch.ones(8)\n"
        "print('torch._inductor' in sys.modules, started)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    imported, seconds = done.stdout.split()
    assert imported == "False" and float(seconds) < 0.5, done.stdout
    events = json.loads((tmp_path / TRACE_NAME.format(rank=0)).read_text())["traceEvents"]
    assert any(event.get("name") == "aten::matmul" for event in events)


FORKED_FROM_A_THREAD = """
import os, sys, threading
import torch
from taas_magic.rank.profiling import profiled

def rank():
    os.environ["RANK"] = "0"
    with profiled(sys.argv[1], "cpu"):
        print("the cell's own line", file=sys.stderr, flush=True)
        torch.ones(8) @ torch.ones(8)
    os._exit(0)

def fork_here():
    pid = os.fork()
    if pid == 0:
        rank()
    os.waitpid(pid, 0)

thread = threading.Thread(target=fork_here)  # not the thread that imported torch
thread.start()
thread.join()
"""


def test_a_rank_forked_from_another_thread_than_torchs_shows_no_complaint_of_kineto(tmp_path):
    """Kineto says ERROR when the profiler starts in another thread than the one torch registered its client
    in, as in a rank forked from a thread of the kernel's: the rank's stderr keeps everything else."""
    run = subprocess.run(
        [sys.executable, "-c", FORKED_FROM_A_THREAD, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "registerClient" not in run.stderr and "the cell's own line" in run.stderr, run.stderr
    assert json.loads((tmp_path / TRACE_NAME.format(rank=0)).read_text())["traceEvents"]
