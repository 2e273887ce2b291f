"""The kernel's end of its connection to a Ray cluster: the cluster driver process, and what the kernel asks it.

The kernel imports no Ray and runs none of Ray's threads: its driver (``driver.py``) does, in a process
of its own, answering one message at a time (the notebook's cells and the runs in the background take
turns), and whatever ends that process (the head gone for a minute, an abort in Ray's C++ core) costs
the connection: the next use says so in one line and ``%taas cluster ADDRESS`` connects again.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from typing import Callable

from taas_magic.configurations import Catalog
from taas_magic.errors import TaasUsageError
from taas_magic.launch.cluster import address_checks
from taas_magic.process import containment, helper
from taas_magic.wire.channel import ChannelBroken
from taas_magic.wire.cluster_driver import (
    Connect,
    Describe,
    Done,
    Failed,
    KernelEnd,
    Notice,
    Release,
    ToDriver,
    kernel_end,
)

STOP_SECONDS = 30.0  # for the driver to end its agents and leave the cluster (agents have 15 s to say goodbye)
STDERR_TAIL = 600  # characters of the driver's standard error told when it died
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colours, which Ray's logging writes
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*(\S+:\d+:\s*)?")  # "[2026-… E 12804 12871] rpc_client.h:204: "
SAID_LENGTH = 160  # characters of the driver's last line told


class DriverGone(ConnectionError):
    """The cluster driver's process ended: ``why`` says how, and the last it wrote."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class DriverProcess:
    """One cluster driver process, the kernel's end of its channel, and its standard error."""

    def __init__(self, notify: Callable[[str], object]) -> None:
        self.notify = notify  # where the driver's notices go: the running cell's stderr
        self.helper = helper.start("taas_magic.launch.cluster.driver", "cluster-driver")
        self.process = self.helper.process
        self.channel: KernelEnd = kernel_end(self.helper.sock, self.helper.secret)
        self.gone: str | None = None  # how it ended, once it did
        self.stopped = False
        # One message at a time: a run in the background asks from its thread while the notebook's cells ask too.
        self._turn = threading.Lock()

    def ask(self, message: ToDriver, fds: list[int] | tuple[int, ...] = ()) -> tuple[Done | Failed, bool]:
        """The driver's answer to ``message``, and whether an interrupt came meanwhile (passed on to the
        driver, which may have answered with it). Raises DriverGone if the driver is gone.

        The driver works on one message at a time, so an interrupt passed on while this one is asked is this
        one's. Only the kernel's main thread passes interrupts on (a run in the background is stopped through its
        pump, with messages of its own); one that comes while it waits for its turn ends the wait, nothing sent."""
        with self._turn:
            return self._ask(message, fds)

    def _ask(self, message: ToDriver, fds: list[int] | tuple[int, ...]) -> tuple[Done | Failed, bool]:
        if self.gone is not None:
            raise DriverGone(self.gone)
        with containment.ForwardedInterrupts(self.process.pid) as held:
            try:
                self.channel.send(message, fds)
                while True:
                    answer, extra = self.channel.receive()
                    for fd in extra:
                        os.close(fd)
                    if not isinstance(answer, Notice):
                        break
                    self.notify(answer.line)
            except ChannelBroken:
                held.came = False
                self.gone = self._death()
                raise DriverGone(self.gone) from None
            came, held.came = held.came, False
        return answer, came

    def call(self, message: ToDriver, fds: list[int] | tuple[int, ...] = ()) -> object:
        """The value the driver answers ``message`` with; its error raised here, or an interrupt that came."""
        answer, interrupted = self.ask(message, fds)
        if isinstance(answer, Failed):
            raise answer.error
        if interrupted:
            raise KeyboardInterrupt
        return answer.value

    def _death(self) -> str:
        """How the driver ended and the last it wrote, once its channel closed."""
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        tail = self._stderr_tail()
        return f"its driver process {helper.ending(code)}" + (f"; it last wrote: {tail}" if tail else "")

    def _stderr_tail(self) -> str:
        text = _ESCAPES.sub("", self.helper.stderr_tail(STDERR_TAIL))
        lines = [line.strip() for line in text.splitlines() if any(c.isalnum() for c in line)]
        return _said(lines[-1]) if lines else ""

    def alive(self) -> bool:
        """Whether the driver still runs; one that ended is reaped and its end kept in ``gone``."""
        if self.stopped:
            return False
        if self.gone is None and self.process.poll() is not None:
            self.gone = self._death()
        return self.gone is None

    def stop(self) -> None:
        """Close the channel (the driver closes its runs, ends its agents and exits); kill it if it lingers.
        Once: a driver that died is stopped too, to free what the kernel held of it."""
        if self.stopped:
            return
        self.stopped = True
        self.channel.close()
        self.helper.ended(STOP_SECONDS)


def _said(line: str) -> str:
    """What a line of Ray's C++ log says, without its time stamp and source, to its first sentences: Ray's
    last words before it ended the driver ("Failed to connect to GCS within 60 seconds. GCS may have
    been killed. …") run on with advice and links for several hundred characters."""
    said = _LOG_PREFIX.sub("", line)
    if len(said) <= SAID_LENGTH:
        return said
    end = said.rfind(". ", 0, SAID_LENGTH)
    return said[: end + 1] + " …" if end > 0 else said[:SAID_LENGTH] + "…"


class ConnectedCluster:
    """The kernel's view of a connected cluster: what it asks of the cluster through its driver."""

    def __init__(self, address: str, driver: DriverProcess):
        self.address = address
        self.driver = driver

    @classmethod
    def connect(cls, address: str, idle_seconds: float, notify: Callable[[str], object]) -> "ConnectedCluster":
        """Start a driver and connect it to the cluster at ``address``; one line if that cannot be done."""
        address_checks.check(address)
        driver = DriverProcess(notify)
        try:
            driver.call(Connect(address, idle_seconds))
        except DriverGone as e:
            driver.stop()
            raise TaasUsageError(f"could not connect to the Ray cluster at {address!r}: {e.why}") from None
        except BaseException:
            driver.stop()
            raise
        return cls(address, driver)

    def lost(self) -> str | None:
        """Why the connection is gone (its driver ended), or None while it holds."""
        return None if self.driver.alive() else self.driver.gone

    def describe(self, catalog: Catalog) -> str:
        return str(self.call(Describe(catalog)))

    def release(self, keep: frozenset[str]) -> tuple[int, int]:
        answer = self.call(Release(keep))
        assert isinstance(answer, tuple)
        released, held = answer
        return int(released), int(held)

    def call(self, message: ToDriver, fds: list[int] | tuple[int, ...] = ()) -> object:
        """The driver's answer to ``message``; a lost connection as one line that says how to go on."""
        try:
            return self.driver.call(message, fds)
        except DriverGone as e:
            raise TaasUsageError(lost_message(self.address, e.why)) from None

    def disconnect(self) -> None:
        self.driver.stop()


def lost_message(address: str, why: str) -> str:
    """What the kernel says of a connection whose driver ended."""
    return (
        f"the connection to the Ray cluster at {address} was lost ({why}): %taas cluster {address} connects "
        "again once the cluster is back, %taas cluster off runs cells on this machine"
    )
