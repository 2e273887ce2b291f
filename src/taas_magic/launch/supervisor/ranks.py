"""The ranks of a run, in its supervisor: started, relayed, signalled and ended.

``ForkedRanks`` lives in the supervisor (whichever way it was started) and owns every rank, producer
and descriptor of the run: each rank leads a process group, holds the read end of a lifeline pipe (it
dies with its supervisor) and is a subreaper of its own; ``close`` kills and reaps them all. Forking
each process, with its pipes, control channel and start gate, is ``forking.py``'s (``ForkingGroup``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, assert_never

from taas_magic.delivery.cluster_ends import AttachedDelivery, FedLoader, NodeEnds
from taas_magic.delivery.service import DataService, RankLoader, SessionLoaders
from taas_magic.launch.supervisor import tasks
from taas_magic.launch.supervisor.forking import ForkedProcess, ForkingGroup
from taas_magic.process import containment, tempfiles
from taas_magic.wire import channel, records
from taas_magic.wire.events import Exited, InputRequest, Key, Output, Relayed, Report, Result, ResultInFile, key_order
from taas_magic.wire.rank_control import (
    PULL_TOGETHER,
    STOP_TOGETHER,
    CellEnd,
    InCell,
    Line,
    Prompt,
    Pulled,
    SessionCell,
    ToRank,
    world_variables,
)
from taas_magic.wire.task import RankTask

READ_SIZE = 1 << 16
ASK_SECONDS = 1.0  # how long a rank asked for its stacks has to answer before faulthandler's signal does

log = logging.getLogger(__name__)


@dataclass
class ForkedRanks(ForkingGroup):
    _pending: list[Relayed] = field(default_factory=list)
    _closed: bool = False
    idle_limit: float | None = None  # a session's: the supervisor ends it after this long without a cell
    # A session's on this machine: the loaders it serves, for loaders it begins to serve while it runs and for a
    # rank started in place of one that died; and the run's id, which names its producers.
    loaders: SessionLoaders | None = None
    run_id: str = ""
    # A session's on a cluster's node: its shares of the run's delivery (the one it started with, then one per cell
    # that began to serve loaders), each local rank's ends kept open for a new process in place of one that died
    # (what the node's agent put in for the dead one waits there).
    attached: list[AttachedDelivery] = field(default_factory=list)
    # A session's on this machine, for a rank started in place of one that died: each rank's environment, and
    # the task its ranks started with.
    envs: dict[int, dict[str, str]] = field(default_factory=dict)
    task: RankTask | None = None

    @property
    def names(self) -> dict[str, Any]:
        return self.shipped if self.shipped is not None else tasks.kernel_namespace()

    @classmethod
    def start(
        cls,
        run_id: str,
        envs: dict[int, dict[str, str]],
        task: RankTask,
        note: Callable[[], bytes] = lambda: b"",
        attached: AttachedDelivery | None = None,
        shipped: dict[str, Any] | None = None,
    ) -> "ForkedRanks":
        """Fork the producers of registered loaders first (they start filling buffers), then the ranks.

        Every process keeps only the sockets it needs: its own delivery channels, and a rank its
        control channel with this supervisor (``rank/session.py``, ``rank/debugger.py``). Once all are
        forked, each is let go with ``note()``: what the kernel found meanwhile (``child.wait_at_gate``).
        ``run_id`` names the run to its producers; ``attached``: a cluster node's share of the run's data
        delivery, set up by its agent; ``shipped``: the names unpacked from a shipment.
        """
        group = cls(idle_limit=task.idle_limit if task.keep else None, shipped=shipped)
        service: DataService | AttachedDelivery | None = None
        stand_ins: tuple[RankLoader | FedLoader, ...] = ()  # what builds each loader's stand-in in a rank
        opening = b""
        try:
            if attached is not None:
                service = attached
            elif task.order.loaders:
                service = DataService(task.order.loaders, group.names, len(envs))
            if service is not None:
                for key, producer in service.producers():
                    group.fork(key, tasks.producer_env(run_id), producer, sockets=service.producer_sockets(key))
                stand_ins = service.rank_loaders()
                plans = tuple(loader.plan for loader in stand_ins)  # those this machine's ranks hold stand-ins of
                task = dataclasses.replace(task, order=dataclasses.replace(task.order, loaders=plans), delivery=None)
            if task.keep and envs:
                group.envs, group.task = envs, task
                group.run_id = run_id
                if attached is None:
                    group.loaders = SessionLoaders(group.names, len(envs))
                else:
                    group.attached = [attached]
            for rank, env in sorted(envs.items()):
                group.fork(
                    rank,
                    env,
                    task,
                    sockets=service.rank_sockets(rank) if service is not None else (),
                    stand_ins=stand_ins,
                )
            opening = note()
        except BaseException:
            group.close()
            raise
        finally:
            group._open_gates(opening)
            if isinstance(service, DataService) and group.loaders is not None:
                group.loaders.keep(service)
            elif service is not None:
                service.close(keep_rank_ends=service in group.attached)
        return group

    # -- watching ---------------------------------------------------------------------------
    def watch(self, fd: int) -> None:
        """Let ``events`` return as soon as ``fd`` is readable too (the supervisor's channel)."""
        self._selector.register(fd, selectors.EVENT_READ, None)

    def running(self) -> set[Key]:
        return {r.rank for r in self.ranks.values() if r.returncode is None}

    def events(self, timeout: float) -> list[Relayed]:
        if self._pending:
            timeout = 0
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                continue  # a watched descriptor: its owner looks at it
            rank, name = key.data
            state = self.ranks[rank]
            # An earlier key of this batch may have ended the rank and closed this descriptor.
            if name == "exit" and state.pidfd == key.fd:
                self._on_exit(state)
            elif name == "control" and state.control is not None and state.control.fileno() == key.fd:
                self._on_message(state)
            elif state.fds.get(name) == key.fd:
                self._read(state, name, key.fd)
        if not hasattr(os, "pidfd_open"):
            self._poll_exits()
        events, self._pending = self._pending, []
        return events

    def _read(self, state: ForkedProcess, name: str, fd: int) -> bool:
        """Read what ``fd`` holds now; True if there was something (there may be more)."""
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._selector.unregister(fd)
            os.close(fd)
            del state.fds[name]
            return False
        if name in ("stdout", "stderr"):
            self._pending.append(Output(state.rank, name, data))
        elif name == "report":
            state.report_buffer += data
            *lines, state.report_buffer = state.report_buffer.split(b"\n")
            for line in lines:
                self._pending.append(Report(state.rank, records.decode(line)))
        else:
            state.stack_text += data.decode("utf-8", "replace")
            state.stack_updated = time.monotonic()
        return True

    def _on_message(self, state: ForkedProcess) -> None:
        """A rank's word on its control channel: the end of a cell, or a request for a line of input.

        What the rank wrote before it is in its pipes already: it goes out first, so a cell's
        output never trails its end, and a debugger's prompt follows what it printed.
        """
        assert state.control is not None
        try:
            message, fds = state.control.receive()
        except channel.ChannelBroken:
            self._drop_control(state)  # the rank is ending: its exit says the rest
            return
        carries_file = isinstance(message, (CellEnd, Pulled)) and message.in_file is not None
        names_file = fds.pop(0) if carries_file and fds else None
        for fd in fds:
            os.close(fd)
        self._drain(state)
        match message:
            case InCell():
                state.cell = "running"
                if state.interrupt_waiting:
                    state.interrupt_waiting = False
                    self._signal(state, signal.SIGINT)
            case CellEnd(record, results, in_file):
                state.cell = "ended"
                if results is not None:
                    self._pending.append(Result(state.rank, results))
                elif in_file is not None and names_file is not None:  # handed on as it is: see ResultInFile
                    self._pending.append(ResultInFile(state.rank, in_file, fd=names_file))
                self._pending.append(Report(state.rank, records.decode(record)))
            case Pulled(number, names, in_file):
                if names is not None:
                    self._pending.append(Result(state.rank, names, pull=number))
                elif in_file is not None and names_file is not None:
                    self._pending.append(ResultInFile(state.rank, in_file, fd=names_file, pull=number))
            case Prompt(prompt):
                self._pending.append(InputRequest(state.rank, prompt))
            case _:
                assert_never(message)

    def _drain(self, state: ForkedProcess) -> None:
        for name in ("stdout", "stderr", "report"):
            while name in state.fds and self._read(state, name, state.fds[name]):
                pass

    def _drop_control(self, state: ForkedProcess) -> None:
        if state.control is not None:
            self._selector.unregister(state.control.fileno())
            state.control.close()
            state.control = None

    def own_sockets(self) -> set[int]:
        """The sockets this supervisor holds for its ranks: their control channels, and a session's ends of the
        channels of the loaders it serves."""
        kept = self.loaders.sockets() if self.loaders is not None else set()
        kept = kept.union(*(attached.sockets() for attached in self.attached))
        return kept | {state.control.fileno() for state in self.ranks.values() if state.control is not None}

    def run_cell(
        self, cell: SessionCell, ranks: Iterable[int], fds: tuple[int, ...] = (), delivery: NodeEnds | None = None
    ) -> None:
        """Send a session's next cell to ``ranks``; a rank that is gone says so by its exit.

        The producers of loaders the session begins to serve with the cell start first, and each
        rank gets its ends of them with the cell. On a cluster's node, ``delivery`` says which of the last of
        ``fds`` are the node's share of those loaders' channels, which its agent made.
        """
        ranks = sorted(ranks)
        if cell.world is not None:
            self._resize(cell)
        # This supervisor's newcomers: on a cluster's node, the cell names every node's. A resize's get their
        # new shares with the cell.
        self._replace(tuple(rank for rank in cell.newcomers if rank in ranks), takes_over=cell.world is None)
        shares = fds[len(fds) - delivery.fd_count() :] if delivery is not None else ()
        fds = fds[: len(fds) - len(shares)]
        service = self._serve_new_loaders(cell, fds, delivery, shares)
        try:
            for rank in ranks:
                if rank in self.ranks:
                    self.ranks[rank].cell, self.ranks[rank].interrupt_waiting = "sent", False
                ends = service.late_ends(rank) if service is not None and rank in self.ranks else ()
                self._tell(rank, cell, fds=fds + ends)
        finally:
            if isinstance(service, DataService) and self.loaders is not None:
                self.loaders.keep(service)
            elif isinstance(service, AttachedDelivery):
                service.close(keep_rank_ends=True)
                self.attached.append(service)

    def _replace(self, ranks: tuple[int, ...], takes_over: bool = True) -> None:
        """Start a new process for each of ``ranks``, a session's that died or new with a resize: it joins the
        session with the cell that heals it (``rank/healing.py``); ``takes_over``: in place of a dead rank, its share
        of each served loader too (a resize's new ranks get theirs with the cell). Forked from this supervisor, as the
        first were: no CUDA here."""
        if self.task is None:
            return  # not a session's
        try:
            for rank in ranks:
                if rank in self.ranks and self.ranks[rank].returncode is None:
                    continue  # alive after all: the cell tells it so
                sockets, stand_ins = self._served_to(rank) if takes_over else (set(), ())
                task = dataclasses.replace(self.task, joins=True)
                self.fork(rank, self.envs[rank], task, sockets=sockets, stand_ins=stand_ins)
        finally:
            self._open_gates(b"")

    def _served_to(self, rank: int) -> tuple[set[int], tuple[RankLoader | FedLoader, ...]]:
        """What a new process in place of ``rank`` keeps of the loaders the session serves (its ends), and what
        builds its stand-ins, which take over the dead rank's share of each."""
        if self.loaders is not None:
            return self.loaders.for_replacement(rank)
        sockets: set[int] = set()
        stand_ins: tuple[RankLoader | FedLoader, ...] = ()
        for attached in self.attached:
            theirs, loaders = attached.for_replacement(rank)
            sockets, stand_ins = sockets | theirs, stand_ins + loaders
        return sockets, stand_ins

    def _resize(self, cell: SessionCell) -> None:
        """``%taas resize``: end the ranks that leave the session (killed and reaped, as a session's end does:
        nothing of theirs stays, and nobody is told they exited), and make the environment of every rank to come
        (a new one, or one in place of a rank that dies later) say the new number of ranks; ``_replace`` then
        starts the new ones. A cluster's node only ever loses ranks so (a lost node's ranks left the session)."""
        assert cell.world is not None
        for state in [state for key, state in self.ranks.items() if cell.leaves(key)]:
            self._retire(state)
        if not self.envs:
            return
        sizes = world_variables(cell.world, cell.nodes)
        kept = {rank: {**env, **sizes} for rank, env in self.envs.items() if rank < cell.world}
        first = kept[min(kept)] if kept else {**self.envs[min(self.envs)], **sizes}
        added = range(max(self.envs) + 1, cell.world) if cell.nodes == 1 else range(0)
        self.envs = kept | {
            rank: first | {name: str(rank) for name in ("RANK", "LOCAL_RANK", "ROLE_RANK")} for rank in added
        }
        if self.loaders is not None:
            self.loaders.world = cell.world

    def _retire(self, state: ForkedProcess) -> None:
        """A rank the session no longer has: gone with whatever it started, its descriptors closed, its events
        dropped."""
        if state.returncode is None:
            self._on_exit(state)  # kills its process group, reaps it, reads its pipes to their end
        self._pending = [event for event in self._pending if event.rank != state.rank]
        for fd in state.fds.values():  # held open by something that left its process group
            self._selector.unregister(fd)
            os.close(fd)
        state.fds.clear()
        if state.ask is not None:
            os.close(state.ask)
            state.ask = None
        del self.ranks[state.rank]

    def _serve_new_loaders(
        self, cell: SessionCell, fds: tuple[int, ...], delivery: NodeEnds | None, shares: tuple[int, ...]
    ) -> DataService | AttachedDelivery | None:
        """Fork the producers of the loaders ``cell`` begins to serve, once its names (the loaders among
        them) are unpacked here; None when it begins to serve none. On a cluster's node, its share of them
        (``delivery``, over the descriptors ``shares``)."""
        plans = cell.order.loaders
        if not plans or (self.loaders is None and delivery is None):
            return None
        from taas_magic.wire import shipping

        namespace = self.loaders.namespace if self.loaders is not None else self.names
        if cell.names:
            shipping.unpack_into(namespace, cell.names, os.dup(fds[0]) if fds else None, cell.tensors_size)
        service: DataService | AttachedDelivery
        if delivery is not None:
            service = delivery.attach([os.dup(fd) for fd in shares], namespace)
        else:
            assert self.loaders is not None
            service = self.loaders.new_service(plans, cell.first_loader, go_on=cell.world is not None)
        try:
            for key, producer in service.producers():
                self.fork(key, tasks.producer_env(self.run_id), producer, sockets=service.producer_sockets(key))
        except BaseException:
            service.close()
            raise
        finally:
            self._open_gates(b"")
        return service

    def answer(self, rank: Key, line: str | None) -> None:
        self._tell(rank, Line(line))

    def _tell(self, rank: Key, message: ToRank, fds: tuple[int, ...] = ()) -> None:
        state = self.ranks.get(rank)
        if state is not None and state.control is not None:
            try:
                state.control.send(message, fds=fds)
            except channel.ChannelBroken:
                pass

    def _on_exit(self, state: ForkedProcess) -> None:
        """A rank ended: stop what it left running, reap it, deliver its last output, then say so.

        Everything the rank itself wrote is in its pipes by now. A pipe that stays open is held by
        something the rank started that left its group: what that writes later still arrives (after
        the exit), and the run's end stops it; nobody waits for it.
        """
        containment.kill_group(state.pid, signal.SIGKILL)  # the rank is a zombie until reaped: its group is its own
        _, status = os.waitpid(state.pid, 0)
        state.returncode = os.waitstatus_to_exitcode(status)
        if state.returncode != 0:
            tempfiles.remove_folders_of(state.pid)  # a killed process could not remove its own
        if state.pidfd is not None:
            self._selector.unregister(state.pidfd)
            os.close(state.pidfd)
            state.pidfd = None
        while state.control is not None and state.control.ready(0):
            self._on_message(state)  # its last words: a cell's end, sent just before it exited
        self._drop_control(state)
        for name, fd in list(state.fds.items()):
            while name in state.fds and self._read(state, name, fd):
                pass
        log.info("%s exited: %s", state.rank, state.returncode)
        self._pending.append(Exited(state.rank, state.returncode))

    def _poll_exits(self) -> None:
        for state in self.ranks.values():
            if state.returncode is None:
                info = os.waitid(os.P_PID, state.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is not None:
                    self._on_exit(state)

    # -- acting on ranks --------------------------------------------------------------------
    def signal(self, signum: int, ranks: Iterable[Key] | None = None) -> None:
        """An interrupt (or a stop, ``STOP_TOGETHER``) reaches a session's rank in its cell only: one for a cell
        on its way waits until the rank takes it; one that comes after its cell ended is too late, and dropped."""
        chosen = self.running() if ranks is None else set(ranks) & self.running()
        for rank in sorted(chosen, key=key_order):
            state = self.ranks[rank]
            if signum in (signal.SIGINT, STOP_TOGETHER) and state.cell != "running":
                state.interrupt_waiting = state.cell == "sent"
                continue
            self._signal(state, signum)

    def _signal(self, state: ForkedProcess, signum: int) -> None:
        if state.returncode is not None:  # a reaped rank's id may belong to someone else now
            return
        if signum in (STOP_TOGETHER, PULL_TOGETHER):
            containment.kill(state.pid, signum)  # the rank's own: its DataLoader's workers have no use for it
        else:
            containment.signal_tree(state.pid, signum)

    def stacks(self, ranks: Iterable[Key], timeout: float) -> dict[Key, str]:
        """Each process's stacks, all its threads'; wait until they stop arriving.

        A rank is asked on its ask pipe: it answers from a thread of its own, with its position of the same
        moment (``rank/vitals.py``). One that has not answered within ``ASK_SECONDS`` (it is still starting,
        or its main thread holds the interpreter in native code), and a producer, get SIGUSR1: faulthandler's
        dump, from the signal handler, without a position.
        """
        chosen = sorted(set(ranks) & self.running(), key=key_order)
        signalled = set()
        for rank in chosen:
            state = self.ranks[rank]
            state.stack_text = ""
            if not state.ask_for_stacks():
                containment.kill(state.pid, signal.SIGUSR1)  # the process alone: its children have no handler
                signalled.add(rank)
        meanwhile: list[Relayed] = []
        asked = time.monotonic()
        deadline = asked + timeout
        while time.monotonic() < deadline:
            states = [self.ranks[r] for r in chosen]
            if all(
                (s.stack_text and time.monotonic() - s.stack_updated > 0.2) or s.returncode is not None for s in states
            ):  # one that exited meanwhile answers no more
                break
            if time.monotonic() - asked > ASK_SECONDS:
                for state in states:
                    if not state.stack_text and state.returncode is None and state.rank not in signalled:
                        containment.kill(state.pid, signal.SIGUSR1)
                        signalled.add(state.rank)
            meanwhile += self.events(min(0.05, max(0.0, deadline - time.monotonic())))
        self._pending = meanwhile + self._pending
        return {rank: self.ranks[rank].stack_text for rank in chosen}

    # -- ending -----------------------------------------------------------------------------
    def close(self) -> None:
        """Kill whatever still runs, reap every rank, close every descriptor. Safe to call twice."""
        if self._closed:
            return
        pending_interrupt = False
        for state in self.ranks.values():
            while state.returncode is None:
                try:
                    self._signal(state, signal.SIGKILL)
                    _, status = os.waitpid(state.pid, 0)
                    state.returncode = os.waitstatus_to_exitcode(status)
                    tempfiles.remove_folders_of(state.pid)
                except ChildProcessError:
                    state.returncode = -signal.SIGKILL
                except KeyboardInterrupt:
                    pending_interrupt = True  # finish cleaning up first
        for state in self.ranks.values():
            state.close_descriptors()
        if self.loaders is not None:
            self.loaders.close()
        for attached in self.attached:
            attached.close()
        for fd in (self._lifeline_read, self._lifeline_write):
            os.close(fd)
        self._selector.close()
        self._closed = True
        if pending_interrupt:
            raise KeyboardInterrupt
