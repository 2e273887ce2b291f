"""Starting a node of a LocalCluster on a busy machine: a raylet gives its agents a fixed time to start and Ray
waits a fixed 30 s for the node to register, so nodes start one at a time on the machine, a start that timed out
is tried again, what each failed start left running is stopped, and the last failure says what the raylet said."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import types

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic import local_cluster

TIMED_OUT = "The current node timed out during startup. This could happen because some of the raylet failed"


@pytest.fixture(autouse=True)
def pauses(monkeypatch) -> list[float]:
    """The pauses between attempts, noted rather than slept."""
    noted: list[float] = []
    clock = types.SimpleNamespace(sleep=noted.append, time=time.time, monotonic=time.monotonic)
    monkeypatch.setattr(local_cluster, "time", clock)
    return noted


@pytest.fixture
def sessions(tmp_path, monkeypatch):
    """An empty folder of Ray's sessions, where the starts of these tests look for their raylets' words."""
    from taas_magic.launch.cluster import ray_private

    monkeypatch.setattr(ray_private, "sessions_folder", lambda: str(tmp_path))
    return tmp_path


def spawning(failures: list[Exception]):
    """A start that leaves a process behind each time, failing with ``failures`` in turn, then succeeding."""
    started: list[subprocess.Popen] = []

    def start() -> str:
        started.append(subprocess.Popen(["sleep", "60"]))
        if failures:
            raise failures.pop(0)
        return "node"

    return start, started


def test_a_start_that_timed_out_is_tried_again_and_its_leftovers_are_stopped(pauses):
    start, started = spawning([Exception(TIMED_OUT), Exception(TIMED_OUT)])
    try:
        assert local_cluster._start_node(start) == "node"
        assert [p.poll() is not None for p in started] == [True, True, False], "the failed starts' processes are gone"
        assert pauses == [local_cluster.START_PAUSE_SECONDS, 2 * local_cluster.START_PAUSE_SECONDS]
    finally:
        for process in started:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    "failures",
    [[Exception(TIMED_OUT)] * local_cluster.START_ATTEMPTS, [RuntimeError("port 6379 is taken")]],
    ids=["every-attempt-timed-out", "another-error"],
)
def test_a_start_that_cannot_succeed_raises_its_error_and_leaves_nothing(failures, sessions):
    start, started = spawning(list(failures))
    with pytest.raises(Exception, match="timed out during startup|port 6379 is taken"):
        local_cluster._start_node(start)
    assert len(started) == len(failures), "only a timeout is tried again"
    assert all(p.poll() is not None for p in started)
    assert not [c for c in psutil.Process().children() if c.pid in {p.pid for p in started}]


def test_the_last_timeout_says_why_the_raylet_aborted(sessions):
    logs = sessions / "session_2026-12-07_01-03-05_305995_1" / "logs"
    logs.mkdir(parents=True)
    old = logs / "raylet.1.out"
    old.write_text("[...] (raylet) main.cc:1: Check failed: an older node's words\n")
    os.utime(old, (time.time() - 3600,) * 2)

    def start() -> None:
        (logs / "raylet.out").write_text(
            "[2026-12-07 01:03:56,809 C 1 1] (raylet) node_manager.cc:3576:  An unexpected system state has occurred. "
            "Check failed: statussetor3576.has_value() Timed out waiting for file /tmp/ray/metrics_agent_port_5f\n"
            "*** StackTrace Information ***\n"
        )
        lagging = time.time() - 0.2  # the file system's clock lags time.time() by up to a tick
        os.utime(logs / "raylet.out", (lagging, lagging))
        raise Exception(TIMED_OUT)

    with pytest.raises(RuntimeError) as raised:
        local_cluster._start_node(start)
    assert str(raised.value).startswith(TIMED_OUT)
    assert str(raised.value).endswith(
        "Its raylet said: statussetor3576.has_value() Timed out waiting for file /tmp/ray/metrics_agent_port_5f"
    )


def test_nodes_start_one_at_a_time_on_the_machine(monkeypatch):
    """The turn is held across threads (and processes) alike: the second start begins when the first ends."""
    monkeypatch.setattr(local_cluster, "time", time)  # waiting for the turn sleeps between tries
    spans: list[tuple[float, float]] = []

    def start() -> None:
        began = time.monotonic()
        time.sleep(0.3)
        spans.append((began, time.monotonic()))

    starts = [threading.Thread(target=local_cluster._start_node, args=(start,)) for _ in range(3)]
    for thread in starts:
        thread.start()
    for thread in starts:
        thread.join()
    spans.sort()
    assert len(spans) == 3 and all(ended <= next_began for (_, ended), (next_began, _) in zip(spans, spans[1:]))


def test_a_start_waits_for_another_process_holding_the_turn_and_not_for_one_that_died(monkeypatch):
    """Another process's start holds the turn: this one waits; killed while it held it, that process leaves nothing
    that keeps it, and this start goes ahead at once."""
    monkeypatch.setattr(local_cluster, "time", time)
    hold = (
        "import socket, sys, time\n"
        "turn = socket.socket(socket.AF_UNIX)\n"
        "turn.bind('\\0' + sys.argv[1])\n"
        "print(flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, local_cluster.START_TURN[1:]], stdout=subprocess.PIPE)
    started: list[float] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        waiting = threading.Thread(target=local_cluster._start_node, args=(lambda: started.append(time.monotonic()),))
        waiting.start()
        time.sleep(1)
        assert not started, "a start went ahead while another process held the turn"
    finally:
        holder.kill()
        holder.wait()
    killed = time.monotonic()
    waiting.join(5)
    assert started and started[0] - killed < 1
    assert local_cluster._start_node(lambda: "node") == "node"


@given(st.integers(0, 255), st.integers(0, 255), st.integers(2, 255), st.integers(1, 8))
def test_the_nodes_count_up_from_any_loopback_address_with_room_for_them(second, third, host, nodes):
    first = f"127.{second}.{third}.{host}"
    if host + nodes <= 256:
        assert local_cluster._loopback_block(first, nodes) == (f"127.{second}.{third}", host)
    else:
        with pytest.raises(ValueError, match=rf"^first_address '{re.escape(first)}' is not allowed: use a loopback"):
            local_cluster._loopback_block(first, nodes)


@given(
    st.none()
    | st.integers()
    | st.text(max_size=20)
    | st.sampled_from(
        [
            "127.0.0.1",
            "127.0.0.0",
            "10.0.0.2",
            "127.0.0",
            "127.0.0.2.3",
            "127.0.0.x",
            "127.0.0.٢",
            "127.256.0.2",
            "127.0.0.254",
        ]
    )
)
def test_a_first_address_that_is_no_loopback_host_is_one_line_naming_it(first):
    fits = re.fullmatch(r"127\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})", first, re.ASCII) if isinstance(first, str) else None
    if fits and int(fits[1]) < 256 and int(fits[2]) < 256 and 2 <= int(fits[3]) <= 253:
        return  # a loopback host with room for 3 nodes: the test above holds these
    with pytest.raises(ValueError) as raised:
        local_cluster._loopback_block(first, 3)
    assert str(raised.value).startswith(f"first_address {first!r} is not allowed") and "\n" not in str(raised.value)
