"""The kernel's cluster driver as a process, without a cluster: its answers, its errors raised in the kernel, its
death read as a lost connection, and what is told of Ray's last words."""

from __future__ import annotations

import os
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.configurations import load_catalog
from taas_magic.errors import RunLost, TaasUsageError
from taas_magic.launch.cluster import driver_link
from taas_magic.launch.cluster.backend import ClusterRanks
from taas_magic.launch.cluster.driver_link import ConnectedCluster, DriverGone, DriverProcess
from taas_magic.wire.cluster_driver import CloseRun, Describe, Done, Poll

GCS_GONE = (
    "[2026-12-06 12:10:30,335 E 12804 12871] rpc_client.h:204: Failed to connect to GCS within 60 seconds. GCS may "
    "have been killed. It's either GCS is terminated by `ray stop` or is killed unexpectedly. If it is killed "
    "unexpectedly, see the log file gcs_server.out. https://docs.ray.io/en/master/ray-observability/user-guides/"
    "configure-logging.html#logging-directory-structure. The program will terminate."
)


@pytest.fixture
def driver():
    notices: list[str] = []
    process = DriverProcess(notices.append)
    yield process
    process.stop()


def test_an_error_in_the_driver_is_raised_in_the_kernel_and_the_driver_answers_on(driver):
    with pytest.raises(TaasUsageError, match="not connected to a cluster"):
        driver.call(Describe(load_catalog()))
    answer, interrupted = driver.ask(CloseRun("run-that-never-was"))  # a run it does not have: nothing to close
    assert answer == Done(None) and not interrupted
    assert driver.alive()


def test_a_run_the_driver_does_not_hold_is_a_lost_run_and_says_nothing_is_running(driver):
    """A kernel's run outliving its driver's knowledge of it (its start failed there) ends as a lost run."""
    group = ClusterRanks(ConnectedCluster("10.0.0.5:6379", driver), "run-that-never-was", print)
    with pytest.raises(RunLost, match="the cluster driver holds no run 'run-that-never-was'"):
        group.events(0.0)
    assert group.running() == set()
    with pytest.raises(RunLost):
        group.stacks(set(), 1.0)
    group.close()
    assert driver.alive()


def test_a_driver_that_died_is_a_lost_connection_told_in_one_line(driver):
    os.kill(driver.process.pid, signal.SIGKILL)
    cluster = ConnectedCluster("10.0.0.5:6379", driver)
    with pytest.raises(TaasUsageError) as raised:
        cluster.describe(load_catalog())
    line = str(raised.value)
    assert line.startswith(
        "the connection to the Ray cluster at 10.0.0.5:6379 was lost (its driver process was killed by SIGKILL)"
    ), line
    assert "%taas cluster 10.0.0.5:6379 connects again" in line and "\n" not in line
    assert cluster.lost() is not None and not driver.alive()
    with pytest.raises(DriverGone):
        driver.ask(Describe(load_catalog()))


def test_a_runs_calls_after_the_driver_died_say_the_run_was_lost_and_its_close_is_quiet(driver):
    cluster = ConnectedCluster("10.0.0.5:6379", driver)
    group = ClusterRanks(cluster, "run-x", print)
    os.kill(driver.process.pid, signal.SIGKILL)
    with pytest.raises(RunLost, match=r"the connection to the Ray cluster at 10\.0\.0\.5:6379 was lost"):
        group.events(0.0)
    assert group.running() == set()
    group.close()  # the run went with the driver: nothing to close, nothing raised
    with pytest.raises(DriverGone):
        driver.ask(Poll("run-x", 0.0))


def test_rays_last_words_are_told_without_stamp_to_their_first_sentences():
    said = driver_link._said(GCS_GONE)
    assert said.startswith("Failed to connect to GCS within 60 seconds. GCS may have been killed.")
    assert said.endswith(" …") and "docs.ray.io" not in said


@given(st.text())
def test_what_is_told_of_any_line_is_short_and_whole_for_short_lines(line):
    said = driver_link._said(line)
    assert len(said) <= driver_link.SAID_LENGTH + 2
    if len(line) <= driver_link.SAID_LENGTH and not line.startswith("["):
        assert said == line
