"""The cluster driver: the process that holds the kernel's connection to a Ray cluster.

Started by the kernel on connecting (``python -m taas_magic.launch.cluster.driver FD``, the channel's
secret on standard input), it is Ray's driver: it connects, places runs, starts and drives the nodes'
agents, and answers the kernel's messages (``wire/cluster_driver.py``) one at a time. Ray's driver ends
its process when the cluster's head is unreachable for a minute, and aborts it when a check in its C++
core fails; here that ends a process of taas's, which the kernel reads as a lost connection, where it
used to end the notebook's kernel.

An interrupt of the kernel that comes while the driver works on its message is passed on as SIGINT and
raised in that work (Ray's waits are interruptible), so a run stops as it did when the driver was the
kernel; one that comes between messages is dropped. The driver ends, and with it every agent and
placement Ray holds for it, when its channel closes (``%taas cluster off``, the kernel's end) or its
parent dies.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from typing import assert_never

from taas_magic.errors import RunLost, TaasUsageError
from taas_magic.launch.cluster import notebook_folder, runs
from taas_magic.launch.cluster.agent import NodePayload
from taas_magic.launch.cluster.connection import Cluster, ray_module
from taas_magic.launch.cluster.runs import ClusterRanks
from taas_magic.launch.supervisor.main import PARENT_CHECK_SECONDS
from taas_magic.process import containment, helper
from taas_magic.wire import memfile, pickler, shipping
from taas_magic.wire.channel import ChannelBroken
from taas_magic.wire.cluster_driver import (
    AnswerLine,
    AskPull,
    AskStacks,
    CloseRun,
    Connect,
    Describe,
    Done,
    DriverEnd,
    Drop,
    Failed,
    Grow,
    Notice,
    Poll,
    Release,
    RunCell,
    Ship,
    Signal,
    StartOnNodes,
    ToDriver,
    driver_end,
)
from taas_magic.wire.events import Key


class Driver:
    """The driver's state: the connected cluster, the payloads shipped and the runs started, by number and id."""

    def __init__(self, channel: DriverEnd):
        self.channel = channel
        self.cluster: Cluster | None = None
        self.payloads: dict[int, tuple[object, notebook_folder.Listing]] = {}  # number -> (in Ray's store, folder)
        self.joining: dict[int, NodePayload] = {}  # number -> a session's, for ranks that join it later
        self.shipped = 0
        self.runs: dict[str, ClusterRanks] = {}

    def answer(self, message: ToDriver, fds: list[int]) -> object:
        """What ``message`` asks for, done."""
        match message:
            case Connect(address, idle_seconds):
                self.cluster = Cluster.connect(address, idle_seconds)
                return None
            case Describe(catalog):
                return self.connected().describe(catalog)
            case Release(keep):
                return self.connected().release(keep=keep)
            case Ship():
                return self._ship(message, fds)
            case Drop(payload):
                self.payloads.pop(payload, None)
                self.joining.pop(payload, None)
                return None
            case StartOnNodes(run_id=run_id, payload=payload):
                shipped, folder = self.payloads[payload]
                joining = self.joining.get(payload)
                run = runs.start(self.connected(), message, shipped, folder, self.notify, joining)
                self.runs[run_id] = run
                return run.nodes()
            case Poll(run_id, timeout):
                return self._run(run_id).events(timeout)
            case Signal(run_id, signum, keys):
                self._run(run_id).signal(signum, keys)
                return None
            case AskStacks(run_id, keys, timeout):
                return self._run(run_id).stacks(keys, timeout)
            case RunCell(run_id, cell, ranks, folder):
                run = self._run(run_id)
                run.tell_if_the_folder_changed(folder, self.notify)
                run.run_cell(cell, ranks, _read(fds, cell.tensors_size))
                return run.nodes()
            case Grow(run_id, world, nodes):
                run = self._run(run_id)
                run.grow(world, nodes)
                return run.nodes()
            case AskPull(run_id, number, names, ranks):
                return self._run(run_id).ask_pull(number, names, ranks)
            case AnswerLine(run_id, key, line):
                self._run(run_id).answer(key, line)
                return None
            case CloseRun(run_id):
                return self._close(run_id)
            case _:
                assert_never(message)

    def connected(self) -> Cluster:
        if self.cluster is None:
            raise TaasUsageError("the cluster driver is not connected to a cluster")  # the kernel connects first
        return self.cluster

    def _run(self, run_id: str) -> ClusterRanks:
        """The run ``run_id``; one this driver does not hold (it was started by a driver before this one, or
        its start failed) is told as a lost run, which the kernel's run already knows how to end."""
        run = self.runs.get(run_id)
        if run is None:
            raise RunLost(f"the cluster driver holds no run {run_id!r}")
        return run

    def running(self, message: ToDriver) -> frozenset[Key]:
        """For a message about a run: which of its processes still run (none once it is closed or lost; the
        run stays until the kernel closes it, answering what is asked of it as a run with nothing left)."""
        run = self.runs.get(getattr(message, "run_id", ""))
        return frozenset() if run is None else frozenset(run.running())

    def _ship(self, message: Ship, fds: list[int]) -> int:
        """The run's payload into Ray's object store, the notebook's folder into its GCS."""
        folder = notebook_folder.listing(message.folder)
        notebook_folder.check(folder)
        package = self.connected().packages.package(folder, self.notify)
        payload = NodePayload(message.task, message.data, _read(fds, message.tensors_size), message.aliases, package)
        self.shipped += 1
        self.payloads[self.shipped] = (ray_module().put(payload), folder)
        if message.task.keep:  # ranks that join the session later are given its names by their peers
            task = dataclasses.replace(message.task, joins=True)
            self.joining[self.shipped] = NodePayload(task, shipping.pack({}, []).data, b"", (), package)
        return self.shipped

    def _close(self, run_id: str) -> tuple[object, bool] | None:
        """Rank 0's files, and whether an interrupt came while the run closed (it closes whole all the same)."""
        run = self.runs.pop(run_id, None)
        if run is None:
            return None
        try:
            return run.close(), False
        except KeyboardInterrupt:
            return run.closed, True

    def notify(self, line: str) -> None:
        self.channel.send(Notice(line))

    def end(self) -> None:
        """Close every run, let the agents go, leave the cluster."""
        for run_id in list(self.runs):
            containment.close_whole(self.runs.pop(run_id).close)
        if self.cluster is not None:
            self.cluster.disconnect()


def main(fd: int) -> None:
    secret = helper.read_secret("cluster driver")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # until a message is being answered: see _answered
    _leave_with_the_parent()
    channel = driver_end(socket.socket(fileno=fd), secret)
    driver = Driver(channel)
    try:
        while True:
            message, fds = channel.receive()
            channel.send(_answered(driver, message, fds))
    except ChannelBroken:
        pass  # the kernel let the cluster go, or is gone
    finally:
        try:
            driver.end()
        finally:
            _leave()


def _answered(driver: Driver, message: ToDriver, fds: list[int]) -> Done | Failed:
    """The answer to ``message``, interruptible by the kernel's SIGINT while it is worked out."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            value = driver.answer(message, fds)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return Done(value, driver.running(message))
    except BaseException as e:  # an interrupt too: the kernel raises it
        return Failed(_portable(e), driver.running(message))
    finally:
        for fd in fds:
            os.close(fd)


def _portable(error: BaseException) -> BaseException:
    """``error``, or one that says the same where it cannot be pickled (Ray's own errors, some of them)."""
    try:
        pickler.dumps(error)
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _read(fds: list[int], size: int) -> bytes:
    return memfile.read_bytes(fds[0], size) if fds and size else b""


def _leave_with_the_parent() -> None:
    """A thread that ends the process when the kernel dies, whatever the main thread waits on: Ray then
    ends the agents and placement groups of this driver, which is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="taas-driver-parent", daemon=True).start()


def _leave() -> None:
    """End at once: finalizing an interpreter that holds Ray's threads can hang on them."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
