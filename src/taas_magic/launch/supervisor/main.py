"""The run's supervisor: one process per run that starts the ranks, relays them, and ends them all.

    kernel ──(fork, or via the fork server)──► supervisor (subreaper) ──fork──► producers, ranks
       ▲                                          │
       └──────── its own authenticated channel ◄──┘

Each run has its own supervisor and its own channel, so nothing of one run can reach the next:
a run the kernel gives up on (an interrupt, a lost message) is simply a closed channel, and the
supervisor answers a closed channel by ending everything. As a subreaper it stays an ancestor
of every process the run starts, however they detach, and kills them all, by process id,
before it says the run is closed. It also ends the run when its parent (the kernel, or the fork
server) dies.

What the two say to each other is ``wire/supervision.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from typing import Callable, NoReturn, assert_never

from taas_magic.delivery.cluster_ends import NodeEnds
from taas_magic.launch.rendezvous import StoreProcess
from taas_magic.launch.supervisor.ranks import ForkedRanks
from taas_magic.launch.supervisor.tasks import Received, StoreServer
from taas_magic.process import containment, logs
from taas_magic.wire.channel import ChannelBroken
from taas_magic.wire.events import Key, Relayed, Report, ResultInFile, key_order
from taas_magic.wire.rank_control import STOP_TOGETHER
from taas_magic.wire.records import CellEnded, Failed
from taas_magic.wire.supervision import (
    AnswerLine,
    AskStacks,
    Close,
    Closed,
    Events,
    FromSupervisor,
    Go,
    Lost,
    PutInStore,
    RunCell,
    SignalRanks,
    Stacks,
    Started,
    StartFailed,
    Stored,
    SupervisorEnd,
    ToSupervisor,
)

log = logging.getLogger(__name__)

PARENT_CHECK_SECONDS = 0.25  # how soon a supervisor notices that its parent died
STOP_SECONDS = 5.0  # the most the supervisor spends ending every process of the run


# -- in the supervisor process -------------------------------------------------------------------
def supervise(
    channel: SupervisorEnd,
    envs: dict[int, dict[str, str]],
    make_task: Callable[[], Received],
    store: StoreServer | None = None,
) -> NoReturn:
    """The whole life of a supervisor, from just after its fork to ``os._exit``.

    ``make_task`` gives the ranks' task: at hand after a fork from the kernel, unpacked from
    what the kernel shipped after a fork from the fork server (a failure there is reported); and on a
    cluster node, its share of the run's data delivery. ``store``: the run's store, to serve once the
    ranks are forked (on a cluster's node 0).
    """
    status = 1
    try:
        env = next(iter(envs.values()), {})  # what every rank's environment says of the run
        logs.follow(env)
        log.info("supervisor of run %s: ranks %s", env.get("TAAS_RUN_ID"), sorted(envs))
        os.setpgid(0, 0)  # the kernel's interrupts are the kernel's to forward
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # Held, not lost, in a rank until it can take them: an interrupt, a request for its stacks (SIGUSR1,
        # whose default ends a process), which the hang doctor or a failure's report may send as it starts, and
        # a session's stop (STOP_TOGETHER, whose default ends a process too).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGUSR1, STOP_TOGETHER})
        containment.become_subreaper()
        _Supervisor(channel, os.getppid()).serve(envs, make_task, store)
        status = 0
    except BaseException:
        log.exception("the supervisor failed")
        traceback.print_exc()
    finally:
        try:
            containment.end_all_children(STOP_SECONDS)
        finally:
            os._exit(status)


class _Supervisor:
    def __init__(self, channel: SupervisorEnd, parent: int):
        self.channel = channel
        self.parent = parent
        self.store: StoreProcess | None = None  # the run's store, when this supervisor serves it

    def serve(
        self, envs: dict[int, dict[str, str]], make_task: Callable[[], Received], store: StoreServer | None
    ) -> None:
        try:
            received = make_task()
            group = ForkedRanks.start(
                self.channel.run_id,
                envs,
                received.task,
                note=self._await_go,
                attached=received.attached,
                shipped=received.shipped,
            )
        except ChannelBroken:
            log.info("the kernel gave up on the run before it started")
            return  # the kernel gave up on the run before it started: everything forked is ended
        except Exception as e:
            log.exception("the run could not start")
            self._send(StartFailed(f"{type(e).__name__}: {e}"))
            return
        if log.isEnabledFor(logging.INFO):
            log.info("started: %s", {key: state.pid for key, state in group.ranks.items()})
        last: list[Relayed] = []
        try:
            # The kernel's, and the ranks' control channels: only now, not to delay the ranks.
            containment.drop_sockets({self.channel.fileno()} | group.own_sockets() | _listening(store))
            # After the ranks' forks and the drop: the store's own process holds its listening socket alone.
            self.store = store.serve() if store is not None else None  # served while the supervisor lives
            group.watch(self.channel.fileno())
            self._send(Started(os.getpid(), tuple(sorted(group.ranks, key=key_order))))
            last = self._relay(group)
        except ChannelBroken:
            log.info("the kernel closed the channel")
            pass  # the kernel gave up on the run, or is gone: end it
        except _Orphaned:
            log.warning("the process that started this supervisor died")
            self._tell_lost("the process that started the run's supervisor died")
        except _Idle as idle:
            log.info("idle for %g s: the session ends", idle.args[0])
            self._tell_lost(f"the session was idle for {idle.args[0]:g} s, its limit (--idle)")
        finally:
            group.close()
        if self.store is not None:  # its port closes before the run is said to be over: the kernel does not wait
            self.store.close()  # for this exit
            self.store = None
        containment.end_all_children(STOP_SECONDS)
        codes = {rank: state.returncode for rank, state in group.ranks.items() if state.returncode is not None}
        log.info("closed; exit statuses %s", codes)
        try:
            self._send(Closed(codes, tuple(last)))
        except ChannelBroken:
            return
        _step_aside()

    def _await_go(self) -> bytes:
        """The kernel's word to let the forked processes go, with what it found while they were
        forked: the notebook's names for the functions ranks replace (``aliases.find``)."""
        message, fds = self.channel.receive()
        for fd in fds:
            os.close(fd)
        if not isinstance(message, Go):
            raise ChannelBroken(f"expected the word to go, got {message.kind!r}")
        return json.dumps(list(message.aliases)).encode()

    def _relay(self, group: "ForkedRanks") -> list[Relayed]:
        """Pass the ranks' events out and the kernel's requests in, until the kernel says close or
        every process of the run has exited (then the kernel need not ask: it learns at once).

        Returns the events that came with the last exit: they go with the word that the run is over.
        """
        idle = _IdleClock(group.idle_limit, busy={key for key in group.ranks if isinstance(key, int)})
        while True:
            events = group.events(PARENT_CHECK_SECONDS)
            if not group.running():
                return events
            if events:
                idle.saw(events)
                self._send(Events(tuple(events)))
            if os.getppid() != self.parent:
                raise _Orphaned()
            if idle.expired():
                raise _Idle(idle.limit)
            # The group reaps its own; the store's process is reaped as it is closed.
            containment.reap_strays({state.pid for state in group.ranks.values()} | _pid(self.store))
            while self.channel.ready(0):
                message, fds = self.channel.receive()
                try:
                    if self._serve(group, message, tuple(fds), idle):
                        return []
                finally:
                    for fd in fds:
                        os.close(fd)

    def _serve(self, group: "ForkedRanks", message: ToSupervisor, fds: tuple[int, ...], idle: "_IdleClock") -> bool:
        """One request of the kernel's; True when it asks to close the run."""
        log.debug("the kernel asks: %s", message.kind)
        match message:
            case Close():
                return True
            case SignalRanks(signum, ranks):
                log.info("signal %d to %s", signum, "every process" if ranks is None else sorted(ranks, key=key_order))
                group.signal(signum, ranks)
            case AskStacks(ranks, timeout):
                stacks = group.stacks(ranks, timeout)
                self._send(Events(tuple(group.events(0))))
                self._send(Stacks(stacks))
            case RunCell(cell, ranks, delivery):  # a session's next cell, for some of its ranks
                idle.busy.update(ranks)
                group.run_cell(cell, ranks, fds, delivery if isinstance(delivery, NodeEnds) else None)
            case PutInStore(key, value):
                if self.store is not None:
                    self.store.set(key, value)
                self._send(Stored(key, self.store is not None))
            case AnswerLine(rank, line):
                group.answer(rank, line)
            case Go():
                raise ChannelBroken(f"unexpected request {message.kind!r}")
            case _:
                assert_never(message)
        return False

    def _send(self, message: FromSupervisor) -> None:
        """Send ``message``, with the files of the names that ranks handed on in it (``ResultInFile``)."""
        events = message.events if isinstance(message, Events) else message.last if isinstance(message, Closed) else ()
        files = [event.fd for event in events if isinstance(event, ResultInFile)]
        try:
            self.channel.send(message, files)
        finally:
            for fd in files:
                os.close(fd)

    def _tell_lost(self, why: str) -> None:
        try:
            self._send(Lost(why))
        except ChannelBroken:
            pass


def _step_aside() -> None:
    """The run is over and the kernel told: this process's exit (tearing down a copy of the kernel's
    memory) must not take the CPU from the kernel finishing the cell."""
    try:
        os.nice(19)
    except OSError:
        pass


class _Orphaned(Exception):
    """The supervisor's parent died: the run cannot go on without the one who asked for it."""


class _Idle(Exception):
    """A session ran no cell for its idle limit: its ranks give back what they hold (GPUs, memory)."""


class _IdleClock:
    """How long a session's ranks have all been waiting for a cell. Without a limit, never expires."""

    def __init__(self, limit: float | None, busy: set[Key]):
        self.limit = limit
        self.busy = busy  # ranks running a cell (every rank runs the first)
        self.since = time.monotonic()

    def saw(self, events: list[Relayed]) -> None:
        if self.busy:
            self.since = time.monotonic()
        for event in events:
            if isinstance(event, Report) and isinstance(event.record, (CellEnded, Failed)):
                self.busy.discard(event.rank)

    def expired(self) -> bool:
        if self.limit is None or self.busy:
            return False
        return time.monotonic() - self.since > self.limit


def _pid(store: StoreProcess | None) -> set[int]:
    return set() if store is None else {store.pid}


def _listening(store: StoreServer | None) -> set[int]:
    return set() if store is None else {store.fd}
