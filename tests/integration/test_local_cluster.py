"""Starting a node of a LocalCluster on a busy machine: Ray waits a fixed 30 s for a node to register, so a
start that timed out is tried again, and what each failed start left running is stopped."""

from __future__ import annotations

import re
import subprocess
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
