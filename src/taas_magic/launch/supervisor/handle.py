"""The kernel's side of a run's supervisor: its process handle and the run as the controller sees it.

A supervisor is started by the kernel (fork), by the fork server, or by a cluster node's agent; whoever
started it holds a ``SupervisorProcess`` to wait for and kill it, and talks to it through
``SupervisedRanks``, the ``RankGroup`` the controller drives.
"""

from __future__ import annotations

import _thread
import os
import select
import signal
import time
from typing import Callable, Iterable, NoReturn, TypeVar, assert_never

from taas_magic.errors import RunLost, TaasRunError
from taas_magic.launch.rendezvous import RunStore
from taas_magic.process import containment
from taas_magic.wire import memfile, results
from taas_magic.wire.channel import ChannelBroken
from taas_magic.wire.events import Event, Exited, Key, Relayed, Result, ResultInFile, key_order
from taas_magic.wire.rank_control import PULL_KEY, PULL_TOGETHER, SessionCell, pull_request
from taas_magic.wire.supervision import (
    AnswerLine,
    AskStacks,
    Close,
    Closed,
    Events,
    FromSupervisor,
    Go,
    KernelEnd,
    Lost,
    PutInStore,
    RunCell,
    SignalRanks,
    Stacks,
    Started,
    StartFailed,
    Stored,
    ToSupervisor,
)
from taas_magic.wire.task import NodeDeliveryEnds

CLOSE_SECONDS = 10.0  # the most a run's end may take before the kernel kills the supervisor
STORE_SECONDS = 5.0  # the most a supervisor that serves the run's store takes to say a value is in it
UNCONFIRMED_SECONDS = 2.0  # how long a supervisor that did not say the run is over has to exit on its own
Answer = TypeVar("Answer", Stacks, Stored)


class SupervisorProcess:
    """The kernel's handle on a supervisor: a pidfd, so it can be waited for and killed without pid races."""

    def __init__(self, pid: int, is_child: bool):
        self.pid = pid
        self.is_child = is_child
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.pidfd = None

    def alive(self) -> bool:
        if self.pidfd is not None:
            return not select.select([self.pidfd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def wait(self, timeout: float) -> bool:
        """Until the process is gone (and reaped, if it is the kernel's child); False if still there after
        ``timeout``."""
        if self.pidfd is not None:
            if not select.select([self.pidfd], [], [], timeout)[0]:
                return False
            if self.is_child:
                containment.reap(self.pid, 0)
            return True
        deadline = time.monotonic() + timeout
        while True:
            if self.is_child:
                containment.reap(self.pid, os.WNOHANG)
            if not self.alive():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def kill(self) -> None:
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass
        self.wait(CLOSE_SECONDS)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def let_go(self) -> None:
        """The supervisor said the run is over and is exiting: let it, without waiting.

        Its exit takes milliseconds (tearing down a copy of the kernel's memory) that nobody
        needs to wait for; a kernel's child is reaped by a short-lived thread the moment it is gone
        (a bare one: ``threading`` would wait for it to start).
        """
        self.close()
        if self.is_child:
            _thread.start_new_thread(containment.reap, (self.pid, 0))


class SupervisedRanks:
    """The controller's view of a run whose ranks live under a supervisor (the RankGroup contract).

    ``process`` is None until the supervisor says who it is, when the fork server started it.
    ``on_lost`` adds what the backend knows to a lost run's message (a fork server's last words).
    """

    def __init__(
        self,
        channel: KernelEnd,
        process: SupervisorProcess | None,
        ranks: Iterable[Key],
        on_lost: Callable[[str], str] | None = None,
        store: RunStore | None = None,
        store_in_supervisor: bool = False,
    ):
        self.channel = channel
        self.process = process
        self.store = store  # the run's TCPStore, served from the kernel until the run is closed
        self.store_in_supervisor = store_in_supervisor  # or served by the supervisor (a cluster run's node 0)
        self.alive = set(ranks)
        self.pending: list[Event] = []
        self.codes: dict[Key, int] = {}
        self.on_lost = on_lost or (lambda detail: detail)
        self.started = False
        self.finished = False  # the supervisor said every process of the run is gone
        self.closed = False

    # -- starting -----------------------------------------------------------------------------
    def wait_started(self, timeout: float, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Until the supervisor says its ranks started; ends the run and raises what went wrong otherwise.
        ``interrupted``: whether an interrupt that a caller holds came, asked every 0.1 s; the run ends then
        and ``KeyboardInterrupt`` is raised."""
        try:
            deadline = time.monotonic() + timeout
            while not self._readable(min(0.1, max(0.0, deadline - time.monotonic()))):
                if interrupted():
                    raise KeyboardInterrupt
                if time.monotonic() >= deadline:
                    self._lose(f"the ranks had not started after {timeout:g} s")
            first = self._receive()
            if isinstance(first, StartFailed):
                message = f"the ranks could not be started: {first.reason}"
                raise TaasRunError(message, [message])
            if not isinstance(first, Started):
                self._lose(f"unexpected first message {first.kind!r}")
            if self.process is None:
                self.process = SupervisorProcess(first.pid, is_child=False)
            self.alive = set(first.processes)  # the ranks, and the producers of registered loaders
            self.started = True
        except BaseException:
            self.close()
            raise

    def _readable(self, timeout: float) -> bool:
        pidfd = self.process.pidfd if self.process is not None else None
        watched = [self.channel.fileno()] + ([pidfd] if pidfd is not None else [])
        ready = select.select(watched, [], [], timeout)[0]
        if self.channel.fileno() in ready:
            return True
        if ready:  # the supervisor is gone and left nothing to read
            self._lose("the run's supervisor exited unexpectedly")
        return False

    def go(self, aliases: tuple[str, ...]) -> None:
        """The kernel's part of the start, done while the supervisor forks: serve the run's store,
        then let the forked processes go once all are forked, telling them the notebook's ``aliases``."""
        if self.store is not None:
            self.store.serve()
        try:
            self.channel.send(Go(aliases))
        except ChannelBroken:
            pass  # the supervisor could not start the run and went: ``wait_started`` reads why

    # -- the RankGroup contract ---------------------------------------------------------------
    def nodes(self) -> frozenset[str]:
        return frozenset()  # a supervisor's ranks are on this machine

    def running(self) -> set[Key]:
        """The processes that have not exited, and those whose exit is received but not handed out yet
        (taking stacks reads events ahead): what they reported before it is in ``events`` still."""
        return set(self.alive) | {event.rank for event in self.pending if isinstance(event, Exited)}

    def events(self, timeout: float) -> list[Event]:
        if not self.pending and self.alive and self._readable(timeout):
            self._take(self._receive())
        events, self.pending = self.pending, []
        return events

    def signal(self, signum: int, ranks: Iterable[Key] | None = None) -> None:
        if self.alive:
            chosen = None if ranks is None else tuple(sorted(set(ranks) & self.alive, key=key_order))
            self._send(SignalRanks(signum, chosen))

    def run_cell(
        self,
        cell: SessionCell,
        ranks: Iterable[int],
        fds: tuple[int, ...] = (),
        delivery: NodeDeliveryEnds | None = None,
    ) -> None:
        """A session's next cell; ``delivery``: a cluster node's share of the loaders it begins to serve, whose
        descriptors come last in ``fds``."""
        ranks = tuple(sorted(ranks))
        self._send(RunCell(cell, ranks, delivery), fds=fds)
        self.alive = cell.alive_after(self.alive, ranks)
        self.pending = [event for event in self.pending if not cell.leaves(event.rank)]

    def answer(self, rank: Key, line: str | None) -> None:
        self._send(AnswerLine(rank, line))

    def ask_pull(self, number: int, names: tuple[str, ...], ranks: tuple[int, ...]) -> bool:
        """Ask the ranks for ``names`` while their cell runs (``PULL_TOGETHER``): the request goes in the run's
        store; ``ranks`` answer (``Result.pull``). False where the store is not here to hold it."""
        if not self.put_in_store(PULL_KEY, pull_request(number, names, ranks)):
            return False
        self.signal(PULL_TOGETHER, ranks)
        return True

    def put_in_store(self, key: str, value: str) -> bool:
        """``value`` under ``key`` in the run's store, for its processes to read: served here, or by the supervisor,
        which says when it is there (a rank of another node may be told to read it right after). False where
        neither serves it, or the supervisor did not say so within ``STORE_SECONDS``."""
        if self.store is not None:
            return self.store.put(key, value)
        if self.store_in_supervisor and self.alive:
            self._send(PutInStore(key, value))
            stored = self._answer(Stored, STORE_SECONDS)
            return stored is not None and stored.done
        return False

    def stacks(self, ranks: Iterable[Key], timeout: float) -> dict[Key, str]:
        """Each of ``ranks``' stacks; none once the run is over. A supervisor leaves once it said the run is
        over, so a request that crosses that word finds the channel at its end, which is no lost run: on a
        cluster, a node whose ranks all failed at once is asked for stacks of the others' failure just then."""
        if self.finished:
            return {}
        self._send(AskStacks(tuple(sorted(ranks, key=key_order)), timeout))
        answer = self._answer(Stacks, timeout + CLOSE_SECONDS)
        return dict(answer.stacks) if answer is not None else {}

    def _answer(self, kind: type[Answer], seconds: float) -> Answer | None:
        """The supervisor's answer of ``kind`` to the request just sent, taking what comes before it; None once the
        run is over or after ``seconds``."""
        deadline = time.monotonic() + seconds
        while not self.finished and time.monotonic() < deadline:
            if self._readable(max(0.0, deadline - time.monotonic())):
                message = self._receive()
                if isinstance(message, kind):
                    return message
                self._take(message)
        return None

    def close(self) -> None:
        """Ask the supervisor to end the run and wait until it has; kill it if it does not answer."""
        self._close(polite=True)

    def _close(self, polite: bool) -> None:
        """``polite``: wait for the supervisor's word that the run is over; else just close the channel,
        which it answers by ending everything, and make sure it is gone.

        All of it with interrupts held: one that comes cuts the waits short and is raised once the run
        is freed. An interrupt let through half-way (Python raises a pending one as any function begins,
        ``to_the_end`` and its steps included) would leave a supervisor unreaped, its descriptors and the
        store's port open, for good, as ``closed`` is already set. One that comes before the hold is
        taken leaves the run open and ``closed`` unset, for the caller's ``close_whole`` to close again.
        """
        with containment.HeldInterrupts() as held:
            if self.closed:
                return
            self.closed = True
            confirmed = self.finished
            try:
                if polite and not confirmed:
                    try:
                        self.channel.send(Close())
                    except ChannelBroken:
                        pass  # it finished and went: what it said last may still be waiting to be read
                    confirmed = self.started and self._wait_closed(held)
            except ChannelBroken:
                pass
            finally:
                self._release(confirmed, held)

    def _release(self, confirmed: bool, held: containment.HeldInterrupts) -> None:
        """Free what the run holds in the kernel: its channel, its supervisor (reaped) and its store. An
        interrupt (``held``) only cuts the wait for an unconfirmed supervisor short: it is killed then."""
        self.alive.clear()
        self.pending.clear()
        self.channel.close()
        process = self.process
        if process is not None and confirmed:
            process.let_go()
        elif process is not None:
            deadline, gone = time.monotonic() + UNCONFIRMED_SECONDS, False
            while not gone and not held.came and time.monotonic() < deadline:
                gone = process.wait(0.05)
            if not gone:
                process.kill()
            process.close()
        if self.store is not None:
            self.store.close()

    def _wait_closed(self, held: containment.HeldInterrupts) -> bool:
        """Until the supervisor says every process of the run is gone, or an interrupt came (``held``):
        whether it said so."""
        deadline = time.monotonic() + CLOSE_SECONDS
        while time.monotonic() < deadline and not held.came:
            if self.channel.ready(min(0.1, max(0.0, deadline - time.monotonic()))):
                message, fds = self.channel.receive()
                for fd in fds:
                    os.close(fd)
                if isinstance(message, Closed):
                    self.codes = dict(message.codes)
                    return True
        return False

    # -- messages -----------------------------------------------------------------------------
    def _receive(self) -> FromSupervisor:
        """The supervisor's next message, with the names a session's ranks handed on in files read in."""
        try:
            message, fds = self.channel.receive()
        except ChannelBroken as e:
            self._lose(str(e))
        try:
            if isinstance(message, Events):
                return Events(self._opened(message.events, fds))
            if isinstance(message, Closed):
                return Closed(message.codes, self._opened(message.last, fds))
            return message
        finally:
            for fd in fds:
                os.close(fd)

    def _opened(self, events: tuple[Relayed, ...], fds: list[int]) -> tuple[Relayed, ...]:
        """``events`` with each ``ResultInFile``'s file (the message's files, in order) received, once it
        is known whole and sealed: its head read, its large spans mapped."""
        files = iter(fds)
        opened: list[Relayed] = []
        for event in events:
            if isinstance(event, ResultInFile):
                fd = next(files, None)
                if fd is None or os.fstat(fd).st_size != max(event.size, 1) or memfile.sealed(fd) is False:
                    self._lose(f"rank {event.rank}'s names arrived damaged")
                event = Result(event.rank, results.receive_file(fd, event.size), event.pull)
            opened.append(event)
        return tuple(opened)

    def _take(self, message: FromSupervisor) -> None:
        match message:
            case Events(events):
                self._take_events(events)
            case Closed(codes, last):
                self._take_events(last)  # the events that came with the end
                if self.alive:
                    self._lose("the run's supervisor ended the run on its own")
                self.codes = dict(codes)
                self.finished = True  # every process exited: the run is over
            case Lost(why):  # the supervisor ended the run without being asked
                self._lose(why)
            case Stacks() | Stored():
                pass  # a reply that came after its request timed out
            case Started() | StartFailed():
                self._lose(f"unexpected message {message.kind!r}")
            case _:
                assert_never(message)

    def _take_events(self, events: tuple[Relayed, ...]) -> None:
        for event in events:
            assert not isinstance(event, ResultInFile), "_receive reads every file in"
            if isinstance(event, Exited):
                self.alive.discard(event.rank)
            self.pending.append(event)

    def _send(self, message: ToSupervisor, fds: tuple[int, ...] = ()) -> None:
        try:
            self.channel.send(message, fds=fds)
        except ChannelBroken as e:
            # The run may have ended and its supervisor gone just before the request: its last
            # words are still here to read, and the request no longer matters.
            while not self.finished and self.channel.ready(0):
                self._take(self._receive())
            if not self.finished:
                self._lose(str(e))

    def _lose(self, detail: str) -> NoReturn:
        """The run cannot be trusted any more: end it from here and say so."""
        self._close(polite=False)
        raise RunLost(self.on_lost(detail))
