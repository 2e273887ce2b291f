"""The fork backend on its own, without a kernel: events, exits, signals, stacks, cleanup."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import psutil
import pytest
from support.descriptors import open_descriptors, opened_since

from taas_magic.launch.supervisor.ranks import ForkedRanks
from taas_magic.wire.events import Exited, Output, Report
from taas_magic.wire.records import CellEnded, Failed, RankActivity, RankVitals
from taas_magic.wire.task import RankTask


def start(source: str, ranks: int = 2):
    task = RankTask(code=compile(source, "<cell>", "exec"), device="cpu", threads=1)
    envs = {rank: {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks)} for rank in range(ranks)}
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


def test_waiting_for_stacks_does_not_spin_when_a_rank_never_answers():
    group = start(
        "import signal, time\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\nprint('go', flush=True)\ntime.sleep(60)",
        ranks=1,
    )
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
    task = RankTask(code=compile("pass", "<cell>", "exec"), device="cpu", threads=1)
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
    task = RankTask(code=compile("pass", "<cell>", "exec"), device="cpu", threads=1)
    group = ForkedRanks.start("test", envs, task, note=note)
    try:
        out = b"".join(e.data for e in collect(group) if isinstance(e, Output))
    finally:
        group.close()
    lines = out.decode().split()
    assert lines[0::2] == ['["keep"]'] * 3
    assert all(float(when) >= opened[0] for when in lines[1::2]), "no process went on before the gate opened"
