"""The CUDA-safe backend: ranks forked from a fork server that never touched CUDA.

The server (``agent.py``) is started in the background when the extension loads, so a cell
never waits for a cold Python and torch import; if it has died it is started again. The cell's
needed names travel by value (``shipping.py``). Everything else — events, signals, stacks —
goes through the same channel, so the controller sees the same ``RankGroup`` as with fork.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterable

from . import channel
from .backend import Event, Exited
from .errors import TaasRunError
from .shipping import Shipment
from .worker import RankTask

READY_SECONDS = 120.0  # a cold start imports torch; on a busy machine that can take a while
CLOSE_SECONDS = 10.0


class AgentDied(TaasRunError):
    """The fork server went away during a run."""

    def __init__(self, detail: str):
        message = f"the taas fork server stopped unexpectedly ({detail}); the next cell starts a new one"
        super().__init__(message, [message])


class Agent:
    """One fork server process and the kernel's end of its channel."""

    def __init__(self) -> None:
        kernel_end, agent_end = socket.socketpair()
        self.sock = kernel_end
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "taas_magic.agent", str(agent_end.fileno())],
                pass_fds=[agent_end.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True,  # the kernel's interrupts are not its own
            )
        finally:
            agent_end.close()
        self.ready = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not select.select([self.sock], [], [], READY_SECONDS)[0]:
            raise AgentDied(f"not ready after {READY_SECONDS:g} s")
        message, _ = channel.receive(self.sock)
        if message[0] != "ready":
            raise AgentDied(f"unexpected first message {message[0]!r}")
        self.ready = True

    def stop(self) -> None:
        """Close the channel (the server exits on EOF); reap it, killing it if it lingers."""
        self.sock.close()
        try:
            self.process.wait(timeout=CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class SpawnRequest:
    """A run for the fork server: the ranks' task and the names shipped for it."""

    task: RankTask
    shipment: Shipment

    def close(self) -> None:
        self.shipment.close()


class SpawnBackend:
    name = "spawn"

    def __init__(self) -> None:
        self._agent: Agent | None = None

    def describe(self) -> str:
        if self._agent is None:
            return "not started"
        return f"running (pid {self._agent.process.pid})" if self._agent.alive() else "stopped (restarts when needed)"

    def warm_up(self) -> None:
        """Start the fork server in the background; the first spawn cell finds it ready."""
        if self._agent is None or not self._agent.alive():
            self._agent = Agent()

    def start(self, envs: dict[int, dict[str, str]], request: SpawnRequest) -> "AgentRanks":
        rank_task, shipment = request.task, request.shipment
        self.warm_up()
        agent = self._agent
        try:
            agent.wait_ready()
            meta = dataclasses.replace(shipment, tensors_fd=None)
            fds = [shipment.tensors_fd] if shipment.tensors_fd is not None else []
            channel.send(agent.sock, ("run", envs, rank_task, meta), fds)
            reply, _ = channel.receive(agent.sock)
        except (channel.ChannelClosed, OSError) as e:
            self.shutdown()
            raise AgentDied(str(e) or type(e).__name__) from e
        if reply[0] == "failed":
            channel.receive(agent.sock)  # ("closed",)
            message = f"the fork server could not start the ranks: {reply[1]}"
            raise TaasRunError(message, [message])
        return AgentRanks(agent, sorted(envs), self)

    def shutdown(self) -> None:
        if self._agent is not None:
            self._agent.stop()
            self._agent = None


class AgentRanks:
    """The controller's view of ranks that live in the fork server."""

    def __init__(self, agent: Agent, ranks: list[int], backend: SpawnBackend):
        self.agent = agent
        self.backend = backend
        self.alive = set(ranks)
        self.pending: list[Event] = []
        self.closed = False

    def running(self) -> set[int]:
        return set(self.alive)

    def events(self, timeout: float) -> list[Event]:
        if not self.pending and select.select([self.agent.sock], [], [], timeout)[0]:
            self._receive_one()
        events, self.pending = self.pending, []
        return events

    def _receive_one(self) -> tuple:
        try:
            message, _ = channel.receive(self.agent.sock)
        except (channel.ChannelClosed, OSError) as e:
            self.alive.clear()
            self.backend.shutdown()
            raise AgentDied(str(e) or "channel closed") from e
        if message[0] == "events":
            for event in message[1]:
                if isinstance(event, Exited):
                    self.alive.discard(event.rank)
            self.pending.extend(message[1])
        return message

    def signal(self, signum: int, ranks: Iterable[int] | None = None) -> None:
        chosen = sorted(self.alive if ranks is None else set(ranks) & self.alive)
        if chosen:
            self._send(("signal", signum, chosen))

    def stacks(self, ranks: Iterable[int], timeout: float) -> dict[int, str]:
        self._send(("stacks", sorted(ranks), timeout))
        deadline = time.monotonic() + timeout + CLOSE_SECONDS
        while time.monotonic() < deadline:
            if select.select([self.agent.sock], [], [], 0.1)[0]:
                message = self._receive_one()
                if message[0] == "stacks":
                    return message[1]
        return {}

    def close(self) -> None:
        """Ask the server to end the run (it kills what still runs) and wait until it has."""
        if self.closed:
            return
        self.closed = True
        interrupted = False
        deadline = time.monotonic() + CLOSE_SECONDS
        try:
            channel.send(self.agent.sock, ("close",))
            while time.monotonic() < deadline:
                try:
                    if select.select([self.agent.sock], [], [], 0.1)[0]:
                        message, _ = channel.receive(self.agent.sock)
                        if message[0] == "closed":
                            break
                except KeyboardInterrupt:
                    interrupted = True  # finish closing first
            else:
                self.backend.shutdown()  # unresponsive: stopping the server stops its ranks
        except (channel.ChannelClosed, OSError):
            self.backend.shutdown()
        if interrupted:
            raise KeyboardInterrupt

    def _send(self, message: tuple) -> None:
        try:
            channel.send(self.agent.sock, message)
        except OSError as e:
            self.alive.clear()
            self.backend.shutdown()
            raise AgentDied(str(e)) from e
