"""The cluster backend: a run's ranks on several nodes of a Ray cluster, behind the same contract.

The kernel prepares a run as for its fork server (the task, the names the cell reads, their tensors)
and hands it to its cluster driver (``driver.py``), which holds the connection to the cluster: the
driver ships it into Ray's object store, places the run's nodes and drives their agents
(``runs.py``). What the kernel holds is the driver's run by its id (``ClusterRanks``): each call of
the RankGroup contract is one message to the driver. The notebook's folder travels as a Ray package
(``notebook_folder.py``, listed and packed by the driver); closing a run brings back what rank 0
wrote, copied here into the notebook's folder.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Iterable

from taas_magic.configurations import Configuration
from taas_magic.errors import RunLost
from taas_magic.launch.backend import Cell, Holding, Launch, MakeTask
from taas_magic.launch.cluster import agent, connection
from taas_magic.launch.cluster.agent import MAX_FILES_BACK, RunFiles
from taas_magic.launch.cluster.driver_link import ConnectedCluster, DriverGone, lost_message
from taas_magic.launch.forkserver.client import notebook_cells, ship
from taas_magic.process import containment
from taas_magic.wire.cluster_driver import (
    AnswerLine,
    AskPull,
    AskStacks,
    CloseRun,
    Drop,
    Failed,
    Grow,
    Poll,
    RunCell,
    Ship,
    Signal,
    StartOnNodes,
    ToDriver,
)
from taas_magic.wire.events import Event, Key
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.task import KernelContext, LoaderPlan, TorchSettings


@dataclass(frozen=True)
class ClusterPlan:
    """A run for the cluster's nodes (the cluster backend's plan)."""

    cluster: ConnectedCluster
    payload: int  # the driver's number for the run's payload, in Ray's object store
    loaders: tuple[LoaderPlan, ...]  # the registered loaders whose producers the run's nodes host
    holding: Holding  # what the ranks hold of the notebook: for a session, what need not be sent again
    profile: str | None = None  # --profile: the kernel's folder for the ranks' traces, which the nodes send

    def close(self) -> None:
        """The payload may go from Ray's object store once the run has started (its nodes have it) or will not."""
        try:
            self.cluster.driver.call(Drop(self.payload))
        except DriverGone:
            pass  # and the payload with it


class ClusterBackend:
    """Runs one cell's ranks on the cluster; made per run, as it knows the run's shape: ``nodes``
    nodes of ``configuration``, and ``producer_node``, the configuration of nodes for data producers
    (None: the producers take turns on the run's own nodes)."""

    name = "cluster"

    def __init__(
        self,
        cluster: ConnectedCluster,
        configuration: Configuration,
        nodes: int,
        notify: Callable[[str], object],
        producer_node: Configuration | None = None,
        keep: bool = False,
    ):
        self.cluster = cluster
        self.configuration = configuration
        self.nodes = nodes
        self.notify = notify  # one line to the cell's stderr: files copied back
        self.producer_node = producer_node
        self.keep = keep  # a session's ranks: they go on without a lost node

    def prepare(self, make_task: MakeTask, cell: Cell) -> ClusterPlan:
        """The run's payload in Ray's object store: the shipped names and tensors (registered loaders
        included, for the nodes that host their producers), and the task with the kernel's torch
        settings and the variables that steer communication (not its whole environment, which is
        the kernel's machine's); and the notebook's folder, as a package in Ray's GCS (the driver lists
        it: Ray's gitignore matcher is what lists it as Ray packs it, and the kernel imports no Ray)."""
        # Each node's agent fills in its own environment, a run folder and its sys.path.
        context = KernelContext(connection.kernel_variables(os.environ), "", [], TorchSettings.of_this_process())
        task = make_task(sources=notebook_cells(cell), context=context)
        cell = dataclasses.replace(cell, reads=cell.reads | {plan.name for plan in task.order.loaders})
        request = ship(task, cell, to="ranks on the cluster's nodes")
        try:
            shipment = request.shipment
            payload = self.cluster.call(
                Ship(request.task, shipment.data, shipment.tensors_size, request.aliases, os.getcwd()),
                [shipment.tensors_fd] if shipment.tensors_fd is not None and shipment.tensors_size else [],
            )
        finally:
            request.close()
        assert isinstance(payload, int)
        return ClusterPlan(self.cluster, payload, task.order.loaders, request.holding, task.order.profile)

    def start(self, plan: ClusterPlan, launch: Launch) -> "ClusterRanks":
        request = StartOnNodes(
            launch.run_id,
            plan.payload,
            self.configuration,
            self.nodes,
            self.producer_node,
            launch.envs,
            plan.loaders,
            plan.profile,
            agent.versions(),  # looked up here: a test makes the kernel claim others
            self.keep,
        )
        group = ClusterRanks(self.cluster, launch.run_id, self.notify)
        try:
            group.start(request)
        except BaseException:
            containment.close_whole(group.close)  # the driver closed a run that failed; one that started
            raise  # as an interrupt came is closed here
        return group


class ClusterRanks:
    """The controller's view of a run spread over nodes (the RankGroup contract): the driver's run ``run_id``."""

    def __init__(
        self,
        cluster: ConnectedCluster,
        run_id: str,
        notify: Callable[[str], object],
    ):
        self.cluster = cluster
        self.run_id = run_id
        self._nodes: frozenset[str] = frozenset()
        self.notify = notify
        self._running: set[Key] = set()
        self.closed = False

    def start(self, request: StartOnNodes) -> None:
        """The driver places the run and starts its ranks on their nodes."""
        self._ask_holding(request)

    # -- the RankGroup contract ---------------------------------------------------------------
    def nodes(self) -> frozenset[str]:
        return self._nodes

    def running(self) -> set[Key]:
        return set(self._running)

    def events(self, timeout: float) -> list[Event]:
        events = self._ask(Poll(self.run_id, timeout))
        assert isinstance(events, list)
        return events

    def signal(self, signum: int, ranks: Iterable[Key] | None = None) -> None:
        self._ask(Signal(self.run_id, signum, None if ranks is None else tuple(ranks)))

    def ask_pull(self, number: int, names: tuple[str, ...], ranks: tuple[int, ...]) -> bool:
        """`%taas pull` while a session's cell runs in the background: node 0 puts the request in the run's store."""
        asked = self._ask(AskPull(self.run_id, number, names, ranks))
        return bool(asked)

    def run_cell(self, cell: SessionCell, ranks: Iterable[int], fds: tuple[int, ...] = ()) -> None:
        """A session's next cell, to the nodes of ``ranks``; its tensors (a memory file here) travel once,
        through Ray's object store."""
        self._ask_holding(RunCell(self.run_id, cell, tuple(ranks), os.getcwd()), fds[:1] if cell.tensors_size else ())

    def grow(self, world: int, nodes: int) -> None:
        """``%taas resize`` to more ranks: the driver starts the new ones on their nodes, to join with the next
        cell; a one-line error, and nothing started, where it cannot."""
        self._ask_holding(Grow(self.run_id, world, nodes))

    def answer(self, rank: Key, line: str | None) -> None:
        self._ask(AnswerLine(self.run_id, rank, line))

    def stacks(self, ranks: Iterable[Key], timeout: float) -> dict[Key, str]:
        stacks = self._ask(AskStacks(self.run_id, tuple(ranks), timeout))
        assert isinstance(stacks, dict)
        return stacks

    def close(self) -> None:
        """End every node's share of the run, release the nodes, bring rank 0's files back."""
        if self.closed:
            return
        self.closed = True
        self._running = set()
        try:
            answer, interrupted = self.cluster.driver.ask(CloseRun(self.run_id))
        except DriverGone:
            return  # the run went with the driver
        if isinstance(answer, Failed):
            raise answer.error
        if isinstance(answer.value, tuple):  # None: the driver had closed the run already
            files, came = answer.value
            interrupted = interrupted or came
            if isinstance(files, RunFiles) and (files.files or files.left):
                self._copy_back(files)
        if interrupted:
            raise KeyboardInterrupt

    # -- the driver's answers -------------------------------------------------------------------
    def _ask_holding(self, message: ToDriver, fds: tuple[int, ...] = ()) -> None:
        """Ask what the driver answers with the nodes the run holds now: its start, a session's cell (a shrink may
        give some back) and a resize's growth (which may add some). They are what `%taas cluster release` spares."""
        nodes = self._ask(message, fds)
        assert isinstance(nodes, frozenset)
        self._nodes = nodes

    def _ask(self, message: ToDriver, fds: tuple[int, ...] = ()) -> object:
        """The driver's answer to ``message`` about this run, and which of the run's processes still run."""
        try:
            answer, interrupted = self.cluster.driver.ask(message, fds)
        except DriverGone as e:
            self._running = set()
            raise RunLost(lost_message(self.cluster.address, e.why)) from None
        self._running = set(answer.running)
        if isinstance(answer, Failed):
            raise answer.error
        if interrupted:
            raise KeyboardInterrupt
        return answer.value

    def _copy_back(self, found: RunFiles) -> None:
        for relative, data in found.files.items():
            path = os.path.join(os.getcwd(), relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as file:
                file.write(data)
        node = found.node
        if found.files:
            self.notify(
                f"taas: rank 0 wrote {', '.join(sorted(found.files))} on node {node}: "
                "copied into this notebook's folder"
            )
        if found.left:
            self.notify(
                f"taas: rank 0 also wrote {', '.join(sorted(found.left))} on node {node}: more than "
                f"{MAX_FILES_BACK // 1024**3} GB in all, so not copied here; they were removed with the "
                "run's folder (save large files under an absolute path on storage you can reach)"
            )
