"""Forking a run's processes, in its supervisor: each one's pipes, control channel and start gate.

Every descriptor of a process is made at its fork, and the new process drops those of the supervisor's
side before it runs anything: one it kept would hold another process's pipe open past that one's exit.
That is a job of its own, apart from watching, signalling and ending the processes, which
``ranks.ForkedRanks`` (a ``ForkingGroup``) does with what is forked here.
"""

from __future__ import annotations

import os
import selectors
import traceback
from dataclasses import dataclass, field
from typing import Any, Collection, Literal

from taas_magic.delivery.cluster_ends import FedLoader
from taas_magic.delivery.producer import ProducerTask
from taas_magic.delivery.service import RankLoader
from taas_magic.launch.supervisor import tasks
from taas_magic.process import child
from taas_magic.wire import channel, rank_control
from taas_magic.wire.events import Key
from taas_magic.wire.task import RankTask

NOTE_LIMIT = 60_000  # a note fits whole in a pipe's buffer (64 KiB)


@dataclass
class ForkedProcess:
    """The supervisor's record of one process it forked: a rank or a producer, its ends, how it is doing."""

    rank: Key  # a rank's number, or a producer
    pid: int
    fds: dict[str, int]  # supervisor-side read ends: stdout, stderr, report, stack
    pidfd: int | None = None
    returncode: int | None = None
    report_buffer: bytes = b""
    stack_text: str = ""
    stack_updated: float = 0.0
    control: rank_control.SupervisorEnd | None = None  # a rank's channel: cells to run, their ends, input requests
    cell: Literal["running", "sent", "ended"] = "running"  # a session's rank: "sent" a cell not taken yet
    interrupt_waiting: bool = False  # an interrupt for the cell it has not taken yet
    ask: int | None = None  # write end of the pipe on which a rank is asked for its stacks (rank/vitals.py)

    def ask_for_stacks(self) -> bool:
        """Ask a rank for its stacks on its ask pipe; False when it has none (a producer) or it is closed."""
        if self.ask is None:
            return False
        try:
            os.write(self.ask, b"?")
        except BlockingIOError:
            pass  # requests it has not read yet fill the pipe: it answers them all at once
        except OSError:
            return False
        return True

    def close_descriptors(self) -> None:
        """Close every descriptor the supervisor holds of this process (as the run ends; it was reaped)."""
        for fd in list(self.fds.values()) + [fd for fd in (self.pidfd, self.ask) if fd is not None]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        self.pidfd = self.ask = None
        if self.control is not None:
            self.control.close()
            self.control = None


@dataclass
class ForkingGroup:
    """The processes of one run as they are forked: each one's record, what every fork shares (the lifeline
    pipe, the control channels' secret, the start gates held shut until all are forked) and the selector
    their descriptors are registered with; ``ranks.ForkedRanks`` watches them and closes it all."""

    ranks: dict[Key, ForkedProcess] = field(default_factory=dict)
    _selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    # The names the ranks start with when they were shipped (the fork server unpacked them); None: the
    # supervisor was forked from the kernel, and so are they, with the notebook's own.
    shipped: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._lifeline_read, self._lifeline_write = os.pipe()
        self._control_secret = channel.new_secret()
        self._gates: list[int] = []  # write ends of each process's start gate, held shut while the run is forked

    def fork(
        self,
        rank: Key,
        env: dict[str, str],
        task: RankTask | ProducerTask,
        sockets: Collection[int] = (),
        stand_ins: tuple[RankLoader | FedLoader, ...] = (),
    ) -> None:
        """Fork one process that runs ``task``: a rank (``worker.run_rank``, its loaders' ``stand_ins``),
        or a data producer."""
        pipes: dict[str, tuple[int, int]] = {}
        ends = channel.socket_pair() if isinstance(rank, int) else None  # (ours, the rank's)
        try:
            for name in ("stdout", "stderr", "report", "stack", "gate") + (("ask",) if isinstance(rank, int) else ()):
                pipes[name] = os.pipe()  # the gate's and ask's write ends stay here, the others' read ends
            pid = os.fork()
        except BaseException:
            for pair in pipes.values():
                for fd in pair:
                    os.close(fd)
            for sock in ends or ():
                sock.close()
            raise
        gate_read, gate_write = pipes.pop("gate")
        ask_read, ask_write = pipes.pop("ask", (None, None))
        if pid == 0:  # the rank: never returns into the supervisor's code
            status = child.EXIT_FAILED
            try:
                os.setpgid(0, 0)
                self._close_supervisor_side(pipes, gate_write, ask_write)
                if ends is not None:
                    ends[0].close()
                fds = child.RankFds(
                    stdout=pipes["stdout"][1],
                    stderr=pipes["stderr"][1],
                    report=pipes["report"][1],
                    stack=pipes["stack"][1],
                    lifeline=self._lifeline_read,
                    sockets=frozenset(sockets),
                    gate=gate_read,
                    control=ends[1].detach() if ends is not None else None,
                    control_secret=self._control_secret,
                    ask=ask_read,
                )
                status = tasks.run_forked(task, env, fds, stand_ins, self.shipped)
            except KeyboardInterrupt:
                pass  # stopped while it started, before the cell ran: the run is being interrupted
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        try:
            os.setpgid(pid, pid)  # also here, so a signal sent right away reaches the new group
        except OSError:
            pass
        for read_end, write_end in pipes.values():
            os.close(write_end)
        os.close(gate_read)
        self._gates.append(gate_write)
        state = ForkedProcess(rank, pid, {name: pair[0] for name, pair in pipes.items()})
        if ask_read is not None and ask_write is not None:
            os.close(ask_read)
            os.set_blocking(ask_write, False)
            state.ask = ask_write
        if ends is not None:
            ends[1].close()
            state.control = rank_control.supervisor_end(ends[0], self._control_secret, env.get("TAAS_RUN_ID", ""))
            self._selector.register(state.control.fileno(), selectors.EVENT_READ, (rank, "control"))
        self.ranks[rank] = state
        for name, fd in state.fds.items():
            os.set_blocking(fd, False)
            self._selector.register(fd, selectors.EVENT_READ, (rank, name))
        if hasattr(os, "pidfd_open"):
            state.pidfd = os.pidfd_open(pid)
            self._selector.register(state.pidfd, selectors.EVENT_READ, (rank, "exit"))

    def _close_supervisor_side(self, own_pipes: dict[str, tuple[int, int]], own_gate: int, own_ask: int | None) -> None:
        """In a new rank: drop every descriptor that belongs to the supervisor's side of the run."""
        fds = [self._lifeline_write, own_gate] + self._gates + [ends[0] for ends in own_pipes.values()]
        fds += [own_ask] if own_ask is not None else []
        for other in self.ranks.values():
            fds += list(other.fds.values()) + ([other.pidfd] if other.pidfd is not None else [])
            fds += [other.ask] if other.ask is not None else []
            fds += [other.control.fileno()] if other.control is not None else []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def _open_gates(self, note: bytes) -> None:
        """Let every forked process go on, with ``note``: written to each one's gate, which is then closed.

        A forked process sets itself up, then waits at the gate (``child.wait_at_gate``) until all
        are forked: forks run one after the other, and each is several times slower while the
        processes forked before it run the cell on the same cores. Their set-up is short, and uses
        a core the forking leaves idle. The ranks meet at the rendezvous anyway, so none loses
        anything by waiting. A note too long to sit in a pipe whole is not sent (the processes then
        do without it).
        """
        for fd in self._gates:
            try:
                if len(note) <= NOTE_LIMIT:
                    os.write(fd, note)  # into an empty pipe: never blocks
            except OSError:
                pass  # the process is gone already
            finally:
                os.close(fd)
        self._gates = []
