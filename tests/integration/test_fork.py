"""The fork backend on its own, without a kernel: events, exits, signals, stacks, cleanup."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time

import psutil
import pytest
from support.descriptors import open_descriptors, opened_since

from taas_magic.launch.supervisor.ranks import ASK_SECONDS, ForkedRanks
from taas_magic.wire.events import Exited, Output, Report
from taas_magic.wire.records import CellEnded, Failed, RankActivity, RankVitals, split_position
from taas_magic.wire.task import CellOrder, RankTask


def start(source: str, ranks: int = 2, env: dict[str, str] | None = None):
    task = RankTask(CellOrder(compile(source, "<cell>", "exec")), device="cpu", threads=1)
    envs = {
        rank: {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), **(env or {})}
        for rank in range(ranks)
    }
    return ForkedRanks.start("test", envs, task)


def collect(group, seconds: float = 20):
    events = []
    deadline = time.monotonic() + seconds
    while group.running() and time.monotonic() < deadline:
        events += group.events(0.05)
    return events


def wait_for(group, token: bytes, count: int = 2, seconds: float = 10) -> None:
    """Until ``token`` was printed ``count`` times: the ranks have reached that line."""
    deadline = time.monotonic() + seconds
    seen = 0
    while seen < count and time.monotonic() < deadline:
        seen += sum(e.data.count(token) for e in group.events(0.05) if isinstance(e, Output))


def test_output_reports_and_exits_arrive_in_order_per_rank():
    group = start("import os, sys\nprint('out', os.environ['RANK'])\nprint('err', file=sys.stderr)")
    try:
        events = collect(group)
    finally:
        group.close()
    for rank in (0, 1):
        mine = [e for e in events if e.rank == rank]
        assert isinstance(mine[-1], Exited) and mine[-1].returncode == 0
        reports = [
            dataclasses.replace(e.record, time=0.0)
            for e in mine
            if isinstance(e, Report) and not isinstance(e.record, (RankVitals, RankActivity))
        ]
        assert reports == [CellEnded(0.0)]
        vitals = [e.record for e in mine if isinstance(e, Report) and isinstance(e.record, RankVitals)]
        assert vitals and vitals[0].memory > 1_000_000, "the rank's memory, sampled as its cell starts"
        assert (
            b"".join(e.data for e in mine if isinstance(e, Output) and e.stream == "stdout") == f"out {rank}\n".encode()
        )
        assert b"".join(e.data for e in mine if isinstance(e, Output) and e.stream == "stderr") == b"err\n"


def test_a_failure_report_carries_the_exception_and_a_timestamp():
    group = start("raise ValueError('nope')", ranks=1)
    try:
        events = collect(group)
    finally:
        group.close()
    (report,) = [e for e in events if isinstance(e, Report) and not isinstance(e.record, (RankVitals, RankActivity))]
    assert isinstance(report.record, Failed) and not report.record.interrupted
    assert report.record.ename == "ValueError"
    assert report.record.evalue == "nope" and report.record.time <= time.monotonic()
    assert any("nope" in line for line in report.record.traceback)
    assert [e.returncode for e in events if isinstance(e, Exited)] == [1]


def test_each_rank_leads_its_own_process_group_and_signals_reach_its_children():
    group = start(
        "import subprocess, time\nsubprocess.Popen(['sleep', '60'])\nprint('ready', flush=True)\ntime.sleep(60)"
    )
    try:
        wait_for(group, b"ready")
        pids = {rank: state.pid for rank, state in group.ranks.items()}
        family = [psutil.Process(pid) for pid in pids.values()]
        family += [child for p in family for child in p.children(recursive=True)]
        assert len(family) == 4
        for rank, pid in pids.items():
            assert os.getpgid(pid) == pid != os.getpgrp()
        group.signal(signal.SIGTERM)
        events = collect(group)
        assert sorted(e.returncode for e in events if isinstance(e, Exited)) == [-signal.SIGTERM] * 2
        _, alive = psutil.wait_procs(family, timeout=3)
        assert alive == []
    finally:
        group.close()


def test_stacks_show_where_each_rank_is():
    group = start("import time\ndef stuck_here():\n    print('go', flush=True)\n    time.sleep(60)\nstuck_here()")
    try:
        wait_for(group, b"go")
        stacks = group.stacks([0, 1], timeout=3)
        assert set(stacks) == {0, 1}
        assert all("stuck_here" in text for text in stacks.values()), stacks
    finally:
        group.close()


def test_stacks_come_with_each_ranks_position_at_the_same_moment():
    """Rank 0 waits in a barrier for rank 1, which sleeps: each rank's stacks begin with where its collectives
    were as they were dumped, read by the rank itself (a SIGUSR1 it ignores changes nothing)."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    envs = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port.getsockname()[1])}
    port.close()
    group = start(
        "import os, signal, time\nimport torch.distributed as dist\n"
        "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
        "dist.init_process_group('gloo')\ndist.barrier()\nprint('go', flush=True)\n"
        "if dist.get_rank() == 0:\n    dist.barrier()\nelse:\n    time.sleep(60)\n",
        env=envs,
    )
    try:
        wait_for(group, b"go", seconds=30)
        time.sleep(0.5)
        positions = {rank: split_position(text) for rank, text in group.stacks([0, 1], timeout=3).items()}
    finally:
        group.close()
    (waiting, waiting_stack), (sleeping, sleeping_stack) = positions[0], positions[1]
    assert waiting is not None and sleeping is not None, positions
    assert [(c.op, c.seq) for c in waiting.collectives] == [("barrier", 2)], waiting
    assert waiting.collectives[0].seconds > 0.3
    assert sleeping.collectives == [] and sleeping.finished == {"0": 1}, sleeping
    assert "in barrier" in waiting_stack and "in <module>" in sleeping_stack and "sleep" not in waiting_stack


def test_a_rank_that_does_not_answer_in_time_is_dumped_by_faulthandler():
    """A rank whose own thread does not answer (its main thread may hold the interpreter) is dumped by
    faulthandler's SIGUSR1, without a position."""
    group = start(
        DEAF.replace("signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n", "") + "import time\n"
        "def stuck_here():\n    print('go', flush=True)\n    time.sleep(60)\nstuck_here()",
        ranks=1,
    )
    try:
        wait_for(group, b"go", count=1)
        asked = time.monotonic()
        position, stack = split_position(group.stacks([0], timeout=3)[0])
        assert time.monotonic() - asked >= ASK_SECONDS
    finally:
        group.close()
    assert position is None and "stuck_here" in stack, stack


def test_close_kills_and_reaps_everything_and_closes_every_descriptor():
    fds_before = open_descriptors()
    group = start("import time\ntime.sleep(60)")
    pids = [state.pid for state in group.ranks.values()]
    group.close()
    group.close()  # twice is harmless
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert opened_since(fds_before) == set()


def test_a_rank_dies_with_its_parent_via_the_lifeline():
    # A child process stands in for the kernel: it forks ranks, then is killed with SIGKILL.
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def fake_kernel():
        group = start("import time\ntime.sleep(60)")
        queue.put([state.pid for state in group.ranks.values()])
        time.sleep(60)

    kernel = ctx.Process(target=fake_kernel)
    kernel.start()
    pids = queue.get(timeout=20)
    os.kill(kernel.pid, signal.SIGKILL)
    kernel.join()
    ranks = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(ranks, timeout=3)
    assert alive == []


# The rank's thread that answers stack requests (rank/vitals.py) takes them and says nothing; SIGUSR1, the
# fallback, is ignored: the rank never answers.
DEAF = (
    "import os, signal, time\nfrom taas_magic.rank import vitals\n"
    "vitals._answer_stack_request = lambda: os.read(vitals._asked, 4096)\n"
    "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
)


def test_waiting_for_stacks_does_not_spin_when_a_rank_never_answers():
    group = start(DEAF + "print('go', flush=True)\ntime.sleep(60)", ranks=1)
    try:
        wait_for(group, b"go", count=1)
        group._pending.append(Output(0, "stdout", b"unread\n"))  # an event nobody has taken yet
        cpu_before = time.process_time()
        assert group.stacks([0], timeout=1.0) == {0: ""}
        assert time.process_time() - cpu_before < 0.3, "waited, not spun"
        assert Output(0, "stdout", b"unread\n") in group.events(0), "events seen while waiting are kept"
    finally:
        group.close()


def test_a_failed_fork_leaks_no_descriptor(monkeypatch):
    group = ForkedRanks()
    fds_before = open_descriptors()

    def no_memory() -> int:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_memory)
    task = RankTask(CellOrder(compile("pass", "<cell>", "exec")), device="cpu", threads=1)
    with pytest.raises(OSError):
        group.fork(0, {"RANK": "0"}, task)
    assert opened_since(fds_before) == set()
    group.close()


def _shows_its_note(task, env, fds, stand_ins, shipped) -> int:
    """A rank that prints what came through its start gate, and when."""
    from taas_magic.process import child

    note = child.wait_at_gate(fds)
    os.write(fds.stdout, b"%s %f\n" % (note, time.monotonic()))
    return 0


def test_every_process_waits_at_its_gate_and_gets_the_note_passed_through_it(monkeypatch):
    from taas_magic.rank import worker

    monkeypatch.setattr(worker, "run_rank", _shows_its_note)
    opened = []

    def note() -> bytes:
        time.sleep(0.3)  # what the kernel finds while the ranks are forked
        opened.append(time.monotonic())
        return b'["keep"]'

    envs = {rank: {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3"} for rank in range(3)}
    task = RankTask(CellOrder(compile("pass", "<cell>", "exec")), device="cpu", threads=1)
    group = ForkedRanks.start("test", envs, task, note=note)
    try:
        out = b"".join(e.data for e in collect(group) if isinstance(e, Output))
    finally:
        group.close()
    lines = out.decode().split()
    assert lines[0::2] == ['["keep"]'] * 3
    assert all(float(when) >= opened[0] for when in lines[1::2]), "no process went on before the gate opened"
