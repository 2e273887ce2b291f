"""The agent on each cluster node: a Ray actor that starts that node's share of every run.

A Ray worker holds gRPC threads, so it never forks: the agent starts taas's own fork server as a
child process and drives it exactly as the kernel does on one machine (``ForkServerBackend``).
The fork server stays warm between cells, so a second cell starts without importing torch again.
If the agent dies (its node, or the kernel that owns it), the fork server sees its parent go and
ends every process of the run.

Each run works in a folder of its own on the node, removed after the run. It starts as a copy of
the notebook's folder (``notebook_folder.py``: Ray's package, unpacked once per node, whose
modules the ranks import); rank 0's relative ``torch.save`` paths land there, and the files it
wrote or changed travel back to the notebook when the run closes.
This module imports no Ray: the kernel wraps ``NodeAgent`` with ``ray.remote`` when it connects.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar, cast

from taas_magic.delivery.cluster import NodeDelivery
from taas_magic.delivery.cluster_share import NodeShare
from taas_magic.errors import DeliveryLost
from taas_magic.launch.cluster import notebook_folder
from taas_magic.launch.cluster.traces import NodeTraces
from taas_magic.launch.forkserver.client import ForkServerBackend, ForkServerRequest
from taas_magic.launch.rendezvous import RunStore
from taas_magic.launch.supervisor.handle import SupervisedRanks
from taas_magic.wire import memfile
from taas_magic.wire.events import Event, Key, key_order
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.shipping import Shipment
from taas_magic.wire.task import KernelContext, RankTask

FOLDER_PREFIX = "taas-run-"  # then the agent's process id: a folder whose agent is gone can be told
MAX_FILES_BACK = 2 * 1024**3  # bytes of rank 0's files a run may send back to the notebook
IDLE_CHECK_SECONDS = 5.0  # how often an agent asks itself whether it has been unused long enough to leave
RAYLET_CHECK_SECONDS = 0.5  # how often an agent looks whether its node's raylet is still its parent


@dataclass(frozen=True)
class NodePayload:
    """What every node of a run receives, once, through Ray's object store."""

    task: RankTask  # its context carries the kernel's torch settings and chosen variables only
    data: bytes  # the shipped names' pickle
    tensors: bytes  # the shipped tensors' data
    aliases: tuple[str, ...]
    package: str | None = None  # the notebook's folder: its Ray package's URI (None: nothing travels)


@dataclass(frozen=True)
class NodeInfo:
    """Who an agent is, to check it can run what the kernel compiled."""

    address: str
    pid: int
    python: str
    torch: str
    taas: str


def versions() -> tuple[str, str, str]:
    """Python, torch and taas versions: a cell compiled by one Python runs only under the same one.

    Read from the installed packages' metadata, not from an imported torch: an agent imports torch only if
    its node holds a run's store (torch costs an agent about 2 s of CPU and 480 MB).
    """
    from importlib.metadata import version

    return platform.python_version(), version("torch"), version("taas-magic")


Method = TypeVar("Method", bound=Callable[..., Any])


def _call(method: Method) -> Method:
    """A call from the kernel: it holds the agent from start to end, so the idle watch never ends
    an agent in the middle of one (a cold start takes seconds), and it counts as use."""

    @functools.wraps(method)
    def call(self: "NodeAgent", *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.last_used = time.monotonic()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.last_used = time.monotonic()

    return cast(Method, call)


class NodeAgent:
    """The body of the Ray actor: one per node, kept between cells, gone after ``idle_seconds`` unused.

    Leaving on its own matters when the kernel goes quiet for hours: the fork server holds memory
    on the node all that time. The kernel notices a departed agent when it next needs the node.
    """

    def __init__(self, idle_seconds: float) -> None:
        import ray

        self.ray = ray
        self.address: str = ray.util.get_node_ip_address()  # this node's, as the cluster knows it
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.backend = ForkServerBackend()
        self.backend.warm_up()  # the first cell finds torch imported
        _remove_orphaned_folders()
        self.store: RunStore | None = None
        self.group: SupervisedRanks | None = None
        # This node's part in the run's data delivery: the share it started with, then those of a session's cells
        # that began to serve loaders registered since (each keyed by its first loader's number).
        self.deliveries: list[NodeDelivery] = []
        self.folder: str | None = None
        self.copies: notebook_folder.Stamps = {}  # the notebook's files as the run's folder started with them
        self.traces = NodeTraces(f"{FOLDER_PREFIX}{os.getpid()}-traces-")  # --profile's, on their way back
        self.idle_seconds = idle_seconds
        self.last_used = time.monotonic()
        self.held_until = 0.0  # a launch under way holds the agent until then (see info)
        self.lock = threading.RLock()  # held by each call from start to end, and by the idle watch
        threading.Thread(target=self._leave_when_idle, name="taas-agent-idle", daemon=True).start()
        threading.Thread(target=_leave_with_the_raylet, name="taas-agent-raylet", daemon=True).start()

    def _leave_when_idle(self) -> None:
        while True:
            time.sleep(min(self.idle_seconds, IDLE_CHECK_SECONDS))
            with self.lock:
                if self.unused(time.monotonic()):
                    self.shutdown()
                    os._exit(0)  # the actor ends with its worker; Ray reports it gone to whoever asks

    def unused(self, now: float) -> bool:
        """No run here, no call for ``idle_seconds``, and no launch holding it: time to leave."""
        return self.group is None and now - self.last_used > self.idle_seconds and now >= self.held_until

    @_call
    def info(self, hold_for: float = 0.0) -> NodeInfo:
        """Who runs here. ``hold_for``: the kernel is about to start a run on this node; the agent stays that
        long however late the launch's next call comes (on a saturated machine the calls of one launch are
        seconds apart, more than a short ``TAAS_CLUSTER_IDLE``), unless the run starts first."""
        self.held_until = max(self.held_until, time.monotonic() + hold_for)
        python, torch_version, taas_version = versions()
        return NodeInfo(self.address, os.getpid(), python, torch_version, taas_version)

    @_call
    def open_store(self, envs: dict[int, dict[str, str]]) -> int:
        """Listen for the run's TCPStore on this node (node 0 of the run); the port, for every node."""
        self._end_run()
        self.store = RunStore(envs)
        return self.store.port

    @_call
    def start(
        self, run_id: str, envs: dict[int, dict[str, str]], payload: NodePayload, share: NodeShare | None
    ) -> list[Key]:
        """Start this node's share of a run: its ranks, and the producers it hosts (``share``); the
        processes' keys once they run."""
        store, self.store = self.store, None
        self.held_until = 0.0  # the run holds the agent now, and its end counts as the last use
        if self.group is not None:
            self._end_run()
        envs = {rank: {**env, "TAAS_NODE_ADDRESS": self.address} for rank, env in envs.items()}
        self.folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        package = notebook_folder.unpacked(payload.package, self.node_id) if payload.package else None
        if package is not None:
            self.copies = notebook_folder.copy_into(package, self.folder)
        delivery = NodeDelivery(share) if share is not None and share.active() else None
        self.deliveries = [delivery] if delivery is not None else []
        request = self._request(payload, self.folder, delivery, package)
        try:
            # Node 0's supervisor serves the run's store: this process never imports torch.
            self.group = self.backend.start_node(run_id, envs, request, store, store_in_supervisor=True)
        finally:
            request.close()
        if delivery is not None:
            self._feed(delivery)
        return sorted(self.group.running(), key=key_order)

    def _feed(self, delivery: NodeDelivery) -> None:
        """The fork server's processes have their ends of ``delivery``'s channels: it streams from now on."""
        delivery.handed_over()
        delivery.start_feeding(lambda ref, timeout: self.ray.get(ref, timeout=timeout))

    def _request(
        self, payload: NodePayload, folder: str, delivery: NodeDelivery | None, package: str | None
    ) -> ForkServerRequest:
        """The fork server's request, with this node's environment, the run's folder, the notebook's
        modules first on ``sys.path`` (``package``) and, when it takes part in data delivery, its
        channels' ends."""
        sent = payload.task.context
        assert sent is not None
        environ = {**os.environ, **sent.environ, "TAAS_NODE_ADDRESS": self.address}  # producers' too
        path = [package, *sys.path] if package is not None else list(sys.path)
        context = KernelContext(environ, folder, path, sent.torch_settings)
        fd = None
        if payload.tensors:
            fd = memfile.new_file("taas-tensors", len(payload.tensors))
            memfile.write_bytes(fd, payload.tensors)
        shipment = Shipment(payload.data, fd, len(payload.tensors))
        ends, fds = delivery.ends() if delivery is not None else (None, [])
        task = dataclasses.replace(payload.task, context=context, delivery=ends, node_traces=self.traces.open())
        return ForkServerRequest(task, shipment, payload.aliases, tuple(fds))

    def relay_address(self, run_id: str) -> tuple[str, int] | None:
        """Where rank nodes connect for the elements this node's producers make: None while the run
        has not started here, ("", 0) when this node serves none (not a ``_call``: asked by rank
        nodes' feeding threads while the kernel's calls wait for events)."""
        delivery = next((d for d in list(self.deliveries) if d.share.run_id == run_id), None)
        if delivery is None:  # not started yet, or over
            time.sleep(0.05)
            return ("", 0) if self.group is not None and not self.deliveries else None
        return delivery.relay_address()

    # -- the RankGroup contract, relayed ---------------------------------------------------------
    @_call
    def events(self, timeout: float) -> NodeEvents:
        """Events so far (waiting up to ``timeout`` for the first), the processes still running, this
        node's copy of each registered loader's counters, and the ``--profile`` traces written since."""
        if self.group is None:
            return NodeEvents([], [], {}, {})
        for delivery in self.deliveries:
            if delivery.failure is not None:
                raise DeliveryLost(delivery.failure)
        events = self.group.events(timeout)
        snapshots = self._snapshots()
        # Listed after the events: a rank writes its trace before it reports its cell's end
        return NodeEvents(events, sorted(self.group.running(), key=key_order), snapshots, self.traces.take())

    @_call
    def signal(self, signum: int, ranks: Iterable[Key] | None = None) -> None:
        if self.group is not None:
            self.group.signal(signum, ranks)

    @_call
    def counters(self) -> dict[int, list[list[int]]]:
        """This node's copy of each registered loader's counters, now (``events`` sends them too)."""
        return self._snapshots()

    def _snapshots(self) -> dict[int, list[list[int]]]:
        """Each share's counters, by the number of its first loader."""
        return {delivery.share.first: delivery.snapshots() for delivery in self.deliveries}

    @_call
    def run_cell(
        self,
        cell: SessionCell,
        ranks: list[int],
        tensors: bytes,
        counters: dict[int, list[list[int]]] | None = None,
        share: NodeShare | None = None,
    ) -> None:
        """A session's next cell for this node's ``ranks``, with its shipped tensors' data. ``counters``: every
        node's merged, for the new processes the cell starts here in place of ranks that died: the rows of the
        producers and ranks of other nodes are copied in first, for them to take over the dead ranks' shares.
        ``share``: this node's part in serving the loaders the cell begins to serve."""
        if self.group is None:
            return
        for delivery in self.deliveries:
            if counters and delivery.share.first in counters:
                delivery.take_counters(counters[delivery.share.first])
        fd = None
        if tensors:
            fd = memfile.new_file("taas-tensors", len(tensors))
            memfile.write_bytes(fd, tensors)
        new = NodeDelivery(share) if share is not None and share.active() else None
        try:
            ends, fds = new.ends() if new is not None else (None, [])
            self.group.run_cell(cell, ranks, ((fd,) if fd is not None else ()) + tuple(fds), ends)
            if new is not None:
                self._feed(new)
                self.deliveries.append(new)
        except BaseException:
            if new is not None:
                new.close()
            raise
        finally:
            if fd is not None:
                os.close(fd)

    @_call
    def put_in_store(self, key: str, value: str) -> bool:
        """``value`` under ``key`` in the run's store (node 0's supervisor serves it); False where it is not here."""
        return self.group is not None and self.group.put_in_store(key, value)

    @_call
    def answer(self, rank: Key, line: str | None) -> None:
        if self.group is not None:
            self.group.answer(rank, line)

    @_call
    def stacks(self, ranks: Iterable[Key], timeout: float) -> dict[Key, str]:
        return self.group.stacks(ranks, timeout) if self.group is not None else {}

    @_call
    def close(self, collect_files: bool) -> RunFiles:
        """End the run here; with ``collect_files``, the files its ranks left in the run's folder; the
        ``--profile`` traces written since the last events in any case (ranks stopped by the close write theirs)."""
        try:
            if self.group is not None:
                self.group.close()
            found = _files_in(self.folder, self.copies) if collect_files and self.folder else RunFiles({}, [])
            return dataclasses.replace(found, traces=self.traces.take())
        finally:
            self._end_run()

    def _end_run(self) -> None:
        group, self.group = self.group, None
        store, self.store = self.store, None
        folder, self.folder = self.folder, None
        self.copies = {}
        deliveries, self.deliveries = self.deliveries, []
        self.traces.close()
        try:
            if group is not None:
                group.close()
        finally:
            for delivery in deliveries:
                delivery.close()
            if store is not None:
                store.close()
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    @_call
    def shutdown(self) -> None:
        """End everything of this agent: the run, if any, and the fork server."""
        try:
            self._end_run()
        finally:
            self.backend.shutdown()


def _leave_with_the_raylet() -> None:
    """End this agent as soon as its node's raylet is gone (killed, out of memory, its machine's Ray stopped).

    Ray does not end a worker whose raylet died: this agent, its fork server and a run's supervisors and ranks
    would hold the node's memory (and GPUs) until the machine restarts, and after the kernel's death too (the
    raylet was the one to end them). The agent is the raylet's child, and a child whose parent dies is given
    to another: its parent changing says the raylet is gone. Nothing here is left to save, and a call in
    progress may wait on the dead raylet for ever: the agent leaves at once, without its lock, and its fork
    server, seeing its parent go, ends every process of the run (``forkserver/server.py``).
    """
    raylet = os.getppid()
    while os.getppid() == raylet:
        time.sleep(RAYLET_CHECK_SECONDS)
    os._exit(0)


def _remove_orphaned_folders() -> None:
    """Run folders of agents that died (killed with their worker, so they could not clean up)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        owner = name[len(FOLDER_PREFIX) :].split("-")[0]
        if name.startswith(FOLDER_PREFIX) and owner.isdecimal() and not _alive(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process
    return True


@dataclass(frozen=True)
class NodeEvents:
    """What a node's agent answers when the kernel asks for events."""

    events: list[Event]
    running: list[Key]  # the processes still running
    snapshots: dict[int, list[list[int]]]  # this node's copy of each registered loader's counters, by share
    traces: dict[str, bytes]  # --profile traces written since the last answer, by file name


@dataclass(frozen=True)
class RunFiles:
    """The files rank 0 left in its run folder, by relative path; those too big to travel, named; and the
    node's last ``--profile`` traces."""

    files: dict[str, bytes]
    left: list[str]
    traces: dict[str, bytes] = dataclasses.field(default_factory=dict)
    node: str = ""  # the node's address, for what the kernel says of the files


def _files_in(folder: str, copies: notebook_folder.Stamps) -> RunFiles:
    """Every regular file under ``folder`` but the notebook's ``copies`` as they were, up to
    MAX_FILES_BACK bytes in all; the rest named."""
    found = RunFiles({}, [])
    total = 0
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            relative = os.path.relpath(path, folder)
            if relative in copies and notebook_folder.stamp(path) == copies[relative]:
                continue
            total += os.path.getsize(path)
            if total > MAX_FILES_BACK:
                found.left.append(relative)
                continue
            with open(path, "rb") as file:
                found.files[relative] = file.read()
    return found
