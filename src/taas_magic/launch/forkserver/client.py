"""The CUDA-safe backend: ranks forked, through a supervisor, from a fork server that never touched CUDA.

The server (``server.py``) is started in the background when the extension loads, so a cell
never waits for a cold Python and torch import; if it has died it is started again. The cell's
needed names travel by value (``wire/shipping.py``). The kernel only ever *sends* to the server, one
datagram per run; the run itself talks to the kernel on its own channel, so the controller sees
the same ``RankGroup`` as with fork, and an interrupt at any moment leaves the server as it was.
The server's standard error goes to a memory file whose tail is shown if it dies.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import subprocess
import threading
from dataclasses import dataclass

from taas_magic.errors import ForkServerDied, RunLost
from taas_magic.launch.backend import Cell, Holding, Launch, MakeTask, Sources
from taas_magic.launch.rendezvous import RunStore
from taas_magic.launch.supervisor.handle import CLOSE_SECONDS, SupervisedRanks
from taas_magic.process import cell_files, containment, helper
from taas_magic.rank import aliases
from taas_magic.wire import channel, fork_server, shipping, supervision
from taas_magic.wire.shipping import Shipment
from taas_magic.wire.task import KernelContext, RankTask

READY_SECONDS = 120.0  # a cold start imports torch; on a busy machine that can take a while
SOURCES_LIMIT = 2_000_000  # characters of the notebook's cells shipped for tracebacks
STDERR_TAIL = 2000  # characters of the server's standard error shown when it died


class ForkServer:
    """One fork server process, the kernel's end of its channel, and its standard error."""

    def __init__(self) -> None:
        self.helper = helper.start("taas_magic.launch.forkserver.server", "fork-server")
        self.process = self.helper.process
        self.stderr = self.helper.stderr
        self.control = fork_server.kernel_end(self.helper.sock, self.helper.secret)

    def alive(self) -> bool:
        return self.process.poll() is None

    def gone(self, within: float) -> bool:
        """Whether the server has exited, or does within ``within`` seconds (its channel closes a moment
        before the process is gone)."""
        try:
            self.process.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return False
        return True

    def describe_death(self) -> str:
        """How the server ended and the last it wrote, for error messages."""
        code = self.process.poll()
        state = "is still running" if code is None else helper.ending(code)
        how = f"the fork server (pid {self.process.pid}) {state}"
        tail = self.stderr_tail()
        return how + (f"; it last wrote: {tail}" if tail else "")

    def stderr_tail(self) -> str:
        return " | ".join(line for line in self.helper.stderr_tail(STDERR_TAIL).splitlines() if line.strip())

    def stop(self) -> None:
        """Close the channel (the server ends everything and exits on EOF); kill it if it lingers."""
        self.control.close()
        self.helper.ended(CLOSE_SECONDS)


@dataclass
class ForkServerRequest:
    """A run for the fork server (the fork server backend's plan): the ranks' task and the names shipped for it."""

    task: RankTask
    shipment: Shipment
    aliases: tuple[str, ...] = ()  # shipped names bound to the functions ranks replace
    delivery_fds: tuple[
        int, ...
    ] = ()  # on a cluster node: the data delivery ends (``task.delivery`` says which is which)

    @property
    def holding(self) -> Holding:
        return Holding(self.shipment.sent, frozenset(self.task.sources))

    def close(self) -> None:
        self.shipment.close()


def ship(task: RankTask, cell: Cell, to: str) -> ForkServerRequest:
    """``task`` with what ranks that do not share the kernel's memory need of the notebook: the names
    the cell reads, by value (``to`` names the ranks in the error for a name that cannot travel)."""
    needed = shipping.needed_names(cell.reads, cell.namespace)
    shipment = shipping.pack(cell.namespace, needed, to, track=task.keep)
    # The ranks' namespace is the shipped names: their aliases are looked for among those alone.
    return ForkServerRequest(task, shipment, aliases.find({name: cell.namespace[name] for name in needed}))


def notebook_cells(cell: Cell) -> Sources:
    """The cell being run and the session's earlier cells, newest first up to SOURCES_LIMIT
    characters, for tracebacks: the notebook's functions that ranks and producers run come from those."""
    sources = {cell.filename: (cell.label, "".join(linecache.getlines(cell.filename)))}
    size = len(sources[cell.filename][1])
    known = cell_files.cell_numbers(cell_files.current_shell()) or {}
    for earlier, number in sorted(known.items(), key=lambda item: -item[1]):
        code = "".join(linecache.getlines(earlier))
        size += len(code)
        if size > SOURCES_LIMIT:
            break
        sources.setdefault(earlier, (f"Cell In[{number}]", code))
    return sources


class ForkServerBackend:
    name = "forkserver"

    def __init__(self) -> None:
        self._server: ForkServer | None = None
        # One start at a time: a background run's thread and a cell may both start runs, and each start is one
        # message on the server's one control channel.
        self._starting = threading.RLock()

    def prepare(self, make_task: MakeTask, cell: Cell) -> ForkServerRequest:
        """The task with the notebook's cells and the kernel's environment, folder, sys.path and torch
        settings; the names the cell reads."""
        task = make_task(sources=notebook_cells(cell), context=KernelContext.of_this_process())
        return ship(task, cell, to="ranks started with --start forkserver")

    def describe(self) -> str:
        if self._server is None:
            return "not started (it starts with the first forkserver cell)"
        return f"running (pid {self._server.process.pid})" if self._server.alive() else "stopped (restarts when needed)"

    def warm_up(self) -> None:
        """Start the fork server in the background; the first forkserver cell finds it ready."""
        if self._server is not None and not self._server.alive():
            self.shutdown()
        if self._server is None:
            self._server = ForkServer()

    def start(self, plan: ForkServerRequest, launch: Launch) -> SupervisedRanks:
        """Hand the run to the fork server; a server that turns out to have died is replaced, once.

        A run lost before its supervisor said "started" ran no code of the cell, so it can be
        handed to a fresh server without the user noticing a server that died while idle.
        """
        with self._starting:
            return self._start(plan, launch)

    def _start(self, plan: ForkServerRequest, launch: Launch) -> SupervisedRanks:
        try:
            return self.start_node(launch.run_id, launch.envs, plan, RunStore(launch.envs))
        except (ForkServerDied, RunLost):
            if self._server is not None and not self._server.gone(within=1.0):
                raise
            self.shutdown()
        return self.start_node(launch.run_id, launch.envs, plan, RunStore(launch.envs))

    def start_node(
        self,
        run_id: str,
        envs: dict[int, dict[str, str]],
        request: ForkServerRequest,
        store: RunStore | None,
        store_in_supervisor: bool = False,
    ) -> SupervisedRanks:
        """Start this machine's share of a run: ``store`` is the run's TCPStore when it is served
        here (its port goes into the ranks' environments), None when another machine serves it; served
        by this process, or with ``store_in_supervisor`` by the run's supervisor (a cluster node's agent
        has no torch of its own to serve it with: ``launch/rendezvous.py``).
        A cluster node that only hosts producers has no ranks (``envs`` is empty)."""
        with self._starting:
            return self._start_node(run_id, envs, request, store, store_in_supervisor)

    def _start_node(
        self,
        run_id: str,
        envs: dict[int, dict[str, str]],
        request: ForkServerRequest,
        store: RunStore | None,
        store_in_supervisor: bool,
    ) -> SupervisedRanks:
        self.warm_up()
        server = self._server
        assert server is not None
        if store is not None:
            envs = store.environments(envs)
        kernel_end, supervisor_end = channel.socket_pair()
        secret = channel.new_secret()
        shipment = dataclasses.replace(request.shipment, tensors_fd=None)
        to_serve, listener = None, []
        if store is not None and store_in_supervisor:
            to_serve = fork_server.StoreToServe(store.host, store.port, store.world_size)
            listener, store = [store.hand_over()], None
        fds = [supervisor_end.fileno(), *listener] + (
            [request.shipment.tensors_fd] if request.shipment.tensors_fd is not None else []
        )
        fds += request.delivery_fds
        try:
            server.control.send(fork_server.StartRun(run_id, secret, envs, request.task, shipment, to_serve), fds=fds)
        except BaseException as e:
            kernel_end.close()
            if store is not None:
                store.close()
            if isinstance(e, channel.ChannelBroken):
                raise ForkServerDied(server.describe_death()) from e
            raise
        finally:
            supervisor_end.close()
            for fd in listener:
                os.close(fd)  # the supervisor's now

        def lost(detail: str) -> str:
            return f"{detail}; {server.describe_death()}" if not server.alive() else detail

        group = SupervisedRanks(
            supervision.kernel_end(kernel_end, secret, run_id),
            None,
            envs,
            on_lost=lost,
            store=store,
            store_in_supervisor=to_serve is not None,
        )
        try:
            group.go(request.aliases)
        except BaseException:
            containment.close_whole(group.close)
            raise
        group.wait_started(READY_SECONDS)
        return group

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
