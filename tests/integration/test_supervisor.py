"""The run's supervisor and the kernel's view of it, without a kernel.

The kernel side is driven against a hand-held channel end, to show what it does with each kind
of message; the whole path (a supervisor forked from this process) is driven as the controller
would drive it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch.distributed  # noqa: F401  (as in a kernel: ranks start with torch imported)
from support.descriptors import open_descriptors, opened_since

from taas_magic.errors import RunLost
from taas_magic.launch.backend import Launch
from taas_magic.launch.fork.backend import ForkBackend, ForkPlan
from taas_magic.launch.supervisor.handle import SupervisedRanks
from taas_magic.process import containment
from taas_magic.wire.channel import new_secret, socket_pair
from taas_magic.wire.events import Exited, Output, Producer
from taas_magic.wire.supervision import (
    Close,
    Closed,
    Events,
    Lost,
    PutInStore,
    Started,
    StartFailed,
    Stored,
    kernel_end,
    supervisor_end,
)
from taas_magic.wire.task import CellOrder, RankTask

PRODUCER = Producer(0, 0)  # a data producer of the run
_TEST_PROCESS = os.getpid()


@pytest.fixture
def ends():
    """The kernel's view, and the supervisor's channel end held by the test; ``sleep`` stands in for its process."""
    kernel_sock, supervisor_sock = socket_pair()
    secret = new_secret()
    supervisor = supervisor_end(supervisor_sock, secret, "run-x")
    group = SupervisedRanks(kernel_end(kernel_sock, secret, "run-x"), None, [0, 1])
    stand_in = psutil.Popen(["sleep", "60"])
    group.stand_in_pid = stand_in.pid
    yield group, supervisor
    supervisor.close()
    stand_in.kill()
    stand_in.wait()
    group.close()


def test_the_kernel_learns_the_processes_of_the_run_when_it_starts(ends):
    group, supervisor = ends
    supervisor.send(Started(group.stand_in_pid, (PRODUCER, 0, 1)))
    group.wait_started(5)
    assert group.running() == {PRODUCER, 0, 1}, "producers count as running processes"
    supervisor.send(Events((Output(0, "stdout", b"hi\n"), Exited(0, 0))))
    assert group.events(1) == [Output(0, "stdout", b"hi\n"), Exited(0, 0)]
    assert group.running() == {PRODUCER, 1}


def test_the_last_events_come_with_the_word_that_the_run_is_over(ends):
    group, supervisor = ends
    supervisor.send(Started(group.stand_in_pid, (0, 1)))
    group.wait_started(5)
    supervisor.send(Events((Exited(0, 0),)))
    supervisor.send(Closed({0: 0, 1: 3}, (Output(1, "stdout", b"bye\n"), Exited(1, 3))))
    assert group.events(1) == [Exited(0, 0)]
    assert group.events(1) == [Output(1, "stdout", b"bye\n"), Exited(1, 3)]
    assert group.running() == set() and group.finished and group.codes == {0: 0, 1: 3}


def test_a_request_that_crosses_the_end_of_the_run_is_moot_not_a_lost_run(ends):
    group, supervisor = ends
    supervisor.send(Started(group.stand_in_pid, (0, PRODUCER)))
    group.wait_started(5)
    supervisor.send(Closed({0: 0, PRODUCER: 0}, (Exited(0, 0), Exited(PRODUCER, 0))))
    supervisor.close()  # the run ended and its supervisor went
    group.signal(signal.SIGTERM, [PRODUCER])  # meanwhile the kernel asked to stop the producer
    assert group.events(1) == [Exited(0, 0), Exited(PRODUCER, 0)]
    assert group.finished and group.running() == set() and group.codes == {0: 0, PRODUCER: 0}


def test_a_failed_start_is_a_run_error_naming_the_reason(ends):
    group, supervisor = ends
    supervisor.send(StartFailed("ModuleNotFoundError: No module named 'gone'"))
    with pytest.raises(Exception, match="could not be started: ModuleNotFoundError"):
        group.wait_started(5)


@pytest.mark.parametrize(
    "message, expected",
    [
        (Lost("the process that started the run's supervisor died"), "supervisor died"),
        (Closed({0: 0}, (Exited(0, 0),)), "ended the run on its own"),
        (Started(1, (0, 1)), "unexpected message 'started'"),
        (Close(), "unexpected message 'close'"),  # a request, on the way back: not a message the kernel takes
    ],
)
def test_a_run_the_supervisor_ended_or_garbled_is_lost_and_closed(ends, message, expected):
    group, supervisor = ends
    supervisor.send(Started(group.stand_in_pid, (0, 1)))
    group.wait_started(5)
    supervisor.send(message)
    with pytest.raises(RunLost, match=expected):
        group.events(1)
    assert group.closed and group.running() == set()


def test_a_supervisor_that_vanishes_before_starting_is_lost(ends):
    group, supervisor = ends
    supervisor.close()
    with pytest.raises(RunLost, match="closed the channel"):
        group.wait_started(5)


def test_close_waits_for_the_supervisor_to_say_everything_is_gone(ends):
    group, supervisor = ends
    supervisor.send(Started(group.stand_in_pid, (0, 1)))
    group.wait_started(5)

    def answer() -> None:
        message, _ = supervisor.receive()
        assert message == Close()
        time.sleep(0.3)
        supervisor.send(Closed({0: 0, 1: -9}, ()))

    helper = threading.Thread(target=answer)
    helper.start()
    began = time.monotonic()
    group.close()
    helper.join()
    assert time.monotonic() - began >= 0.3
    assert group.codes == {0: 0, 1: -9}


@pytest.mark.parametrize("served", [True, False])
def test_a_value_put_in_the_store_a_supervisor_serves_is_there_once_the_put_returns(ends, served):
    """On a cluster, node 0's supervisor serves the run's store, and a `%taas pull` tells the ranks of every node to
    read its request right after putting it: the put returns once the supervisor said it is there (a rank told
    through another node read the request before it, and answered that one), keeping what came before the answer."""
    group, supervisor = ends
    group.store_in_supervisor = True
    supervisor.send(Started(group.stand_in_pid, (0, 1)))
    group.wait_started(5)

    def answer() -> None:
        message, _ = supervisor.receive()
        assert message == PutInStore("taas/pull", "{}")
        time.sleep(0.3)
        supervisor.send(Events((Output(0, "stdout", b"meanwhile\n"),)))
        supervisor.send(Stored("taas/pull", served))

    helper = threading.Thread(target=answer)
    helper.start()
    began = time.monotonic()
    assert group.put_in_store("taas/pull", "{}") is served
    helper.join()
    assert time.monotonic() - began >= 0.3, "not before the supervisor's word"
    assert group.events(0) == [Output(0, "stdout", b"meanwhile\n")], "what came first is kept"


def test_a_supervisor_that_never_says_the_value_is_stored_is_no_put(ends, monkeypatch):
    group, supervisor = ends
    group.store_in_supervisor = True
    supervisor.send(Started(group.stand_in_pid, (0, 1)))
    group.wait_started(5)
    monkeypatch.setattr("taas_magic.launch.supervisor.handle.STORE_SECONDS", 0.2)
    assert group.put_in_store("taas/pull", "{}") is False
    supervisor.send(Stored("taas/pull", True))  # too late: taken as a stale answer, not a lost run
    assert group.events(0.2) == [] and not group.closed


# -- the whole path --------------------------------------------------------------------------------
def envs(ranks: int) -> dict[int, dict[str, str]]:
    shared = {"TAAS_RUN_ID": "taas-test", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(ranks)}
    return {rank: {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(ranks)}


def run_to_end(source: str, ranks: int = 2, seconds: float = 30) -> tuple[list, SupervisedRanks]:
    task = RankTask(CellOrder(compile(source, "<cell>", "exec")), device="cpu", threads=1)
    group = ForkBackend().start(ForkPlan(task), Launch("taas-test", envs(ranks)))
    events = []
    deadline = time.monotonic() + seconds
    try:
        while group.running() and time.monotonic() < deadline:
            events += group.events(0.1)
    finally:
        group.close()
    return events, group


def test_a_run_through_a_supervisor_forked_from_here_leaves_nothing():
    fds_before = open_descriptors()
    events, group = run_to_end("import os\nprint('rank', os.environ['RANK'], os.environ['MASTER_PORT'])")
    text = b"".join(e.data for e in events if isinstance(e, Output) and e.stream == "stdout").decode()
    ports = {line.split()[2] for line in text.splitlines() if line.startswith("rank ")}
    assert len(ports) == 1 and ports != {"0"}, f"the supervisor opened the store's port: {events}"
    assert sorted(e.rank for e in events if isinstance(e, Exited)) == [0, 1]
    deadline = time.monotonic() + 2
    while containment.children() and time.monotonic() < deadline:
        time.sleep(0.01)  # the supervisor said the run was over and is exiting: it is reaped as it goes
    assert containment.children() == [], "the supervisor was reaped"
    assert opened_since(fds_before) == set()


_SLOW_RANK_START = [False]  # while set, each rank spends 1 s in its fork, before it can take any signal
os.register_at_fork(
    after_in_child=lambda: time.sleep(1) if _SLOW_RANK_START[0] and os.getppid() != _TEST_PROCESS else None
)


def test_a_request_for_stacks_while_ranks_start_is_answered_once_they_can_and_ends_none():
    """The hang doctor, or the report of another rank's failure, may ask a rank for its stacks (SIGUSR1) before
    it has set its handler: the signal's default would end it, and the run would report that as its failure."""
    task = RankTask(CellOrder(compile("import time\ntime.sleep(60)", "<cell>", "exec")), device="cpu", threads=1)
    _SLOW_RANK_START[0] = True
    try:
        group = ForkBackend().start(ForkPlan(task), Launch("taas-test", envs(2)))
    finally:
        _SLOW_RANK_START[0] = False
    try:
        stacks = group.stacks([0, 1], timeout=10)
        assert all(stacks.values()) and set(stacks) == {0, 1}, stacks
        assert not [e for e in group.events(0.5) if isinstance(e, Exited)], "no rank ended"
        assert group.running() == {0, 1}
    finally:
        group.close()


def test_killing_the_supervisor_ends_the_run_as_lost_and_its_ranks_die():
    source = "import time\nprint('up', flush=True)\ntime.sleep(60)"
    task = RankTask(CellOrder(compile(source, "<cell>", "exec")), device="cpu", threads=1)
    group = ForkBackend().start(ForkPlan(task), Launch("taas-test", envs(2)))
    try:
        ranks = psutil.Process(group.process.pid).children()
        assert len(ranks) == 2
        os.kill(group.process.pid, signal.SIGKILL)
        with pytest.raises(RunLost):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                group.events(0.1)
        _, alive = psutil.wait_procs(ranks, timeout=5)
        assert alive == [], "ranks die with their supervisor (the lifeline)"
    finally:
        group.close()


class InterruptStorm:
    """Interrupts for this process as a user's repeated ones land in a kernel freeing a run, at any point
    Python takes them (a function's first instruction among them): while ``raining``, SIGINT about every
    0.1 ms from a process of its own (a thread here would send one per switch of the interpreter's lock);
    while ``armed``, each raised as ``KeyboardInterrupt`` only where it lands in taas's code, the test's
    own lines around the calls out of their way."""

    def __init__(self) -> None:
        self.armed, self.timer, self.received = False, None, 0
        self.previous = signal.signal(signal.SIGINT, self._handle)
        self.sender: subprocess.Popen | None = None

    def _handle(self, signum: int, frame) -> None:
        self.received += 1
        while frame is not None and self.armed:
            if "taas_magic" in frame.f_code.co_filename:
                raise KeyboardInterrupt
            frame = frame.f_back

    def rain(self) -> None:
        """From once the first has come (the sender takes a while to start)."""
        rain = f"import os, time\nwhile True:\n    os.kill({os.getpid()}, 2)\n    time.sleep(0.0001)"
        self.sender, received = subprocess.Popen([sys.executable, "-c", rain]), self.received
        while self.received == received:
            time.sleep(0.001)
        self.armed = True

    def clear(self) -> None:
        if self.sender is not None:
            self.sender.kill()
            self.sender.wait()
            self.sender = None
        time.sleep(0.01)  # what was sent is taken by this handler, armed no more
        self.armed = False

    def one_after(self, seconds: float) -> None:
        """A single interrupt, ``seconds`` from now, raised wherever it lands in taas's code."""
        self.armed = True
        self.timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
        self.timer.start()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()
        self.clear()
        signal.signal(signal.SIGINT, self.previous)


def test_interrupts_raining_on_a_run_as_it_starts_and_closes_leave_no_process_descriptor_or_port():
    """Each start or close an interrupt cut short is begun again, as the controller does: a close, once
    under way, frees the whole run whatever lands meanwhile, and one cut before it began leaves the run
    to close again. Before, an interrupt at the first instruction of a step of the release left the
    supervisor unreaped (a zombie of the kernel's), the channel and the store's port open, for good."""
    task = RankTask(CellOrder(compile("import time\ntime.sleep(30)", "<cell>", "exec")), device="cpu", threads=1)
    fds_before = open_descriptors()
    storm, interrupted = InterruptStorm(), 0
    try:
        for attempt in range(12):
            group = None
            if attempt % 2:  # odd attempts: one interrupt as it starts, each at another point
                storm.one_after(0.004 * attempt)
            while group is None:
                try:
                    group = ForkBackend().start(ForkPlan(task), Launch("taas-test", envs(2)))
                except KeyboardInterrupt:
                    interrupted += 1
            if storm.timer is not None:
                storm.timer.join()  # landed in this start or as it ended, not in the next
            storm.rain()
            while not group.closed:  # closed or, cut before it began, to close again
                try:
                    group.close()
                except KeyboardInterrupt:
                    interrupted += 1
            storm.clear()
            assert group.closed
        assert interrupted > 6, "the interrupts did not land in taas's code"
    finally:
        storm.stop()
    deadline = time.monotonic() + 5
    while containment.children() and time.monotonic() < deadline:
        time.sleep(0.01)  # a supervisor let go is reaped by a thread as it exits
    assert containment.children() == [], "every supervisor was reaped"
    assert opened_since(fds_before) == set(), "every channel, pidfd and store port was closed"
