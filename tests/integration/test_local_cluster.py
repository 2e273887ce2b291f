"""Starting a node of a LocalCluster on a busy machine: Ray waits a fixed 30 s for a node to register, so a
start that timed out is tried again, and what each failed start left running is stopped."""

from __future__ import annotations

import subprocess
import types

import psutil
import pytest

from taas_magic import local_cluster

TIMED_OUT = "The current node timed out during startup. This could happen because some of the raylet failed"


@pytest.fixture(autouse=True)
def pauses(monkeypatch) -> list[float]:
    """The pauses between attempts, noted rather than slept."""
    noted: list[float] = []
    monkeypatch.setattr(local_cluster, "time", types.SimpleNamespace(sleep=noted.append))
    return noted


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
def test_a_start_that_cannot_succeed_raises_its_error_and_leaves_nothing(failures):
    start, started = spawning(list(failures))
    with pytest.raises(Exception, match="timed out during startup|port 6379 is taken"):
        local_cluster._start_node(start)
    assert len(started) == len(failures), "only a timeout is tried again"
    assert all(p.poll() is not None for p in started)
    assert not [c for c in psutil.Process().children() if c.pid in {p.pid for p in started}]
