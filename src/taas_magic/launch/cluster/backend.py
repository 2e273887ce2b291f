"""The cluster backend: a run's ranks on several nodes of a Ray cluster, behind the same contract.

    kernel ── Ray ──► placement group (one whole node per bundle)
                      ├─ node 0: agent ─ fork server ─ ranks 0..k-1   (serves the run's TCPStore)
                      ├─ node 1: agent ─ fork server ─ ranks k..2k-1
                      └─ c1.4 nodes, when the cell uses registered loaders: agent ─ fork server ─ producers
                         (each rank node's agent pulls its ranks' batches from them: delivery/cluster.py)

The payload (the task and the names the cell reads, tensor data included) goes into Ray's object
store once; each node's agent fetches it once for all its ranks. The kernel polls every node's
agent for events in parallel; a node or agent that dies turns into a cell error naming it, and
the other nodes' ranks are stopped. The notebook's folder travels as a Ray package
(``notebook_folder.py``); closing a run ends every node's share, releases the nodes and copies
what rank 0 wrote back into the notebook's folder.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from taas_magic.configurations import Configuration
from taas_magic.delivery.cluster_share import NodeShare, RunProgress, shares
from taas_magic.errors import RunLost, TaasUsageError, first_line
from taas_magic.launch.backend import Cell, Holding, Launch, MakeTask
from taas_magic.launch.cluster import notebook_folder, traces
from taas_magic.launch.cluster.agent import MAX_FILES_BACK, NodePayload, RunFiles
from taas_magic.launch.cluster.connection import Cluster, Node, Placement, kernel_variables, ray_module
from taas_magic.launch.forkserver.client import notebook_cells, ship
from taas_magic.launch.supervisor.handle import CLOSE_SECONDS
from taas_magic.process import containment
from taas_magic.wire.events import Event, Key, Report, key_order
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.task import KernelContext, LoaderPlan, TorchSettings

CALL_SECONDS = 15.0  # the longest an agent may take to answer beyond what was asked of it
START_SECONDS = 150.0  # a cold agent imports torch before its ranks start


@dataclass(frozen=True)
class ClusterPlan:
    """A run for the cluster's nodes (the cluster backend's plan)."""

    payload: object  # a reference to the ``NodePayload`` in Ray's object store, fetched once by each node
    loaders: tuple[LoaderPlan, ...]  # the registered loaders whose producers the run's nodes host
    holding: Holding  # what the ranks hold of the notebook: for a session, what need not be sent again
    folder: notebook_folder.Listing | None = None  # what of the notebook's folder travelled with the run
    profile: str | None = None  # --profile: the kernel's folder for the ranks' traces, which the nodes send

    def close(self) -> None:
        pass  # the payload stays in Ray's object store while it is referenced, then Ray frees it


class ClusterBackend:
    """Runs one cell's ranks on the cluster; made per run, as it knows the run's shape: ``nodes``
    nodes of ``configuration``, and ``producer_node``, the configuration of nodes for data producers
    (None: the producers take turns on the run's own nodes)."""

    name = "cluster"

    def __init__(
        self,
        cluster: Cluster,
        configuration: Configuration,
        nodes: int,
        notify: Callable[[str], object],
        producer_node: Configuration | None = None,
    ):
        self.cluster = cluster
        self.configuration = configuration
        self.nodes = nodes
        self.notify = notify  # one line to the cell's stderr: files copied back
        self.producer_node = producer_node

    def prepare(self, make_task: MakeTask, cell: Cell) -> ClusterPlan:
        """The run's payload in Ray's object store: the shipped names and tensors (registered loaders
        included, for the nodes that host their producers), and the task with the kernel's torch
        settings and the variables that steer communication (not its whole environment, which is
        the kernel's machine's); and the notebook's folder, as a package in Ray's GCS. A folder too
        large to travel fails the cell first."""
        folder = notebook_folder.listing(os.getcwd())
        notebook_folder.check(folder)
        # Each node's agent fills in its own environment, a run folder and its sys.path.
        context = KernelContext(kernel_variables(os.environ), "", [], TorchSettings.of_this_process())
        task = make_task(sources=notebook_cells(cell), context=context)
        cell = dataclasses.replace(cell, reads=cell.reads | {plan.name for plan in task.loaders})
        request = ship(task, cell, to="ranks on the cluster's nodes")
        try:
            package = self.cluster.packages.package(folder, self.notify)
            payload = NodePayload(
                request.task,
                request.shipment.data,
                _read(request.shipment.tensors_fd, request.shipment.tensors_size),
                request.aliases,
                package,
            )
        finally:
            request.close()
        return ClusterPlan(ray_module().put(payload), task.loaders, request.holding, folder, task.profile)

    def start(self, plan: ClusterPlan, launch: Launch) -> "ClusterRanks":
        producers = sum(loader.producers for loader in plan.loaders)
        placement = self.cluster.place(self.configuration, self.nodes, producers, self.producer_node)
        try:
            agents = self.cluster.agents_on(placement.nodes)
        except BaseException:
            placement.release()
            raise
        per_node = _on_nodes(launch.envs, placement.nodes)
        node_shares = (
            shares(
                launch.run_id,
                plan.loaders,
                [tuple(sorted(node)) for node in per_node[: self.nodes]],
                placement.hosts,
                agents,
                [node.address for node in placement.nodes],
            )
            if plan.loaders
            else None
        )
        group = ClusterRanks(self.cluster, placement, agents, self.notify, node_shares, plan.folder, plan.profile)
        try:
            group.start(launch.run_id, per_node, plan.payload)
        except BaseException:
            containment.close_whole(group.close)
            raise
        return group


def _on_nodes(envs: dict[int, dict[str, str]], nodes: list[Node]) -> list[dict[int, dict[str, str]]]:
    """Each node's ranks' environments, pointed at node 0, which serves the run's store (nodes that
    host producers alone have none)."""
    master = nodes[0].address
    per_node: list[dict[int, dict[str, str]]] = [{} for _ in nodes]
    for rank, env in envs.items():
        per_node[int(env["GROUP_RANK"])][rank] = {**env, "MASTER_ADDR": master}
    return per_node


def _read(fd: int | None, size: int) -> bytes:
    if fd is None or size == 0:
        return b""
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as memory:
        return memory[:]


class ClusterRanks:
    """The controller's view of a run spread over nodes (the RankGroup contract)."""

    def __init__(
        self,
        cluster: Cluster,
        placement: Placement,
        agents: list[Any],
        notify: Callable[[str], object],
        shares: list[NodeShare] | None = None,
        folder: notebook_folder.Listing | None = None,
        profile: str | None = None,
    ):
        self.cluster = cluster
        self.placement = placement
        self.agents = agents  # in node-rank order, then the nodes that host producers alone
        self.notify = notify
        self.shares = shares  # each node's part in data delivery, when the cell uses registered loaders
        self.progress = RunProgress(shares) if shares else None
        self.alive: list[set[Key]] = [set() for _ in agents]
        self.folder = folder  # the notebook's folder as it travelled with the run
        self.told = ""  # the folder's fingerprint when a session's cell last said it changed
        self.profile = profile  # the running cell's --profile folder here: where the nodes' traces go
        self.closed = False

    def start(self, run_id: str, envs: list[dict[int, dict[str, str]]], payload: object) -> None:
        """Node 0 opens the store first (its port goes to every node), then every node starts at once."""
        port = self._call([0], lambda index: self.agents[index].open_store.remote(envs[0]), CALL_SECONDS)[0]
        envs = [
            {
                rank: {**env, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
                for rank, env in node.items()
            }
            for node in envs
        ]
        refs = [
            agent.start.remote(run_id, envs[index], payload, self.shares[index] if self.shares else None)
            for index, agent in enumerate(self.agents)
        ]
        for index, keys in enumerate(self._wait(list(range(len(self.agents))), refs, START_SECONDS)):
            self.alive[index] = set(keys)

    # -- the RankGroup contract ---------------------------------------------------------------
    def nodes(self) -> frozenset[str]:
        return frozenset(node.node_id for node in self.placement.nodes)

    def running(self) -> set[Key]:
        return set().union(*self.alive)

    def events(self, timeout: float) -> list[Event]:
        live = [index for index, keys in enumerate(self.alive) if keys]
        answers = self._call(live, lambda index: self.agents[index].events.remote(timeout), timeout + CALL_SECONDS)
        events: list[Event] = []
        for index, answer in zip(live, answers):
            events += answer.events
            self.alive[index] = set(answer.running)
            traces.write_into(self.profile, answer.traces)
            if self.progress is not None and answer.snapshots:
                events += [Report(key, record) for key, record in self.progress.take(index, answer.snapshots)]
        return events

    def signal(self, signum: int, ranks: Iterable[Key] | None = None) -> None:
        chosen = None if ranks is None else set(ranks)
        live = [index for index, keys in enumerate(self.alive) if keys and (chosen is None or keys & chosen)]
        self._call(
            live,
            lambda index: self.agents[index].signal.remote(
                signum, None if chosen is None else sorted(chosen & self.alive[index], key=key_order)
            ),
            CALL_SECONDS,
        )

    def run_cell(self, cell: SessionCell, ranks: Iterable[int], fds: tuple[int, ...] = ()) -> None:
        """A session's next cell, to the nodes of ``ranks``; its tensors (a memory file here) travel once,
        through Ray's object store."""
        self._tell_if_the_folder_changed()
        chosen = set(ranks)
        self.profile = cell.profile
        tensors = ray_module().put(_read(fds[0], cell.tensors_size) if fds else b"")
        live = [index for index, keys in enumerate(self.alive) if keys & chosen]
        self._call(
            live,
            lambda index: self.agents[index].run_cell.remote(
                cell, sorted(key for key in chosen & self.alive[index] if isinstance(key, int)), tensors
            ),
            CALL_SECONDS,
        )

    def _tell_if_the_folder_changed(self) -> None:
        """A session's ranks keep the notebook's files they started with: an edit since then is
        said once, not silently ignored."""
        if self.folder is None:
            return
        try:
            now = notebook_folder.listing(os.getcwd())
        except (OSError, TaasUsageError):  # the folder went, or cannot be read: the ranks have theirs
            return
        changed = now.changed_since(self.folder)
        if changed and now.fingerprint() != self.told:
            self.told = now.fingerprint()
            self.notify(notebook_folder.news_of_changes(changed))

    def answer(self, rank: Key, line: str | None) -> None:
        live = [index for index, keys in enumerate(self.alive) if rank in keys]
        self._call(live, lambda index: self.agents[index].answer.remote(rank, line), CALL_SECONDS)

    def stacks(self, ranks: Iterable[Key], timeout: float) -> dict[Key, str]:
        chosen = set(ranks)
        live = [index for index, keys in enumerate(self.alive) if keys & chosen]
        stacks: dict[Key, str] = {}
        asked = self._call(
            live,
            lambda index: self.agents[index].stacks.remote(sorted(chosen & self.alive[index], key=key_order), timeout),
            timeout + CALL_SECONDS,
        )
        for answer in asked:
            stacks.update(answer)
        return stacks

    def close(self) -> None:
        """End every node's share of the run, release the nodes, bring rank 0's files back."""
        if self.closed:
            return
        self.closed = True
        ray = ray_module()
        interrupted = False
        files = RunFiles({}, [])
        refs = [_sent(lambda: agent.close.remote(index == 0)) for index, agent in enumerate(self.agents)]
        try:
            for index, ref in enumerate(refs):
                try:
                    if ref is None:
                        raise ConnectionError("its agent cannot be reached")
                    answer = ray.get(ref, timeout=CLOSE_SECONDS + CALL_SECONDS)
                except KeyboardInterrupt:
                    interrupted = True  # finish closing first
                    answer = ray.get(ref, timeout=CLOSE_SECONDS + CALL_SECONDS)
                except Exception:
                    self.cluster.forget(self.placement.nodes[index].node_id)
                    continue
                traces.write_into(self.profile, answer.traces)
                if index == 0:
                    files = answer
        finally:
            self.alive = [set() for _ in self.agents]
            try:
                self.placement.release()
            except Exception:
                pass  # the cluster is gone, and its placement groups with it
        if files.files or files.left:
            self._copy_back(files)
        if interrupted:
            raise KeyboardInterrupt

    def _copy_back(self, found: RunFiles) -> None:
        for relative, data in found.files.items():
            path = os.path.join(os.getcwd(), relative)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as file:
                file.write(data)
        node = self.placement.nodes[0].address
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

    # -- calls to the agents ------------------------------------------------------------------
    def _call(self, indexes: list[int], request: Callable[[int], Any], timeout: float) -> list[Any]:
        refs = []
        for index in indexes:
            try:
                refs.append(request(index))
            except Exception as e:  # Ray could not even send it: the agent's actor, or the connection, is gone
                self.cluster.forget(self.placement.nodes[index].node_id)
                self._lose(index, f"its agent cannot be reached ({first_line(e)})", None)
        return self._wait(indexes, refs, timeout)

    def _wait(self, indexes: list[int], refs: list[Any], timeout: float) -> list[Any]:
        """The agents' answers; a node that died or does not answer ends the whole run."""
        ray = ray_module()
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        answers = []
        for index, ref in zip(indexes, refs):
            try:
                answers.append(ray.get(ref, timeout=timeout))
            except RayTaskError as e:  # the agent raised: its own run was lost, or could not start
                cause = e.cause if isinstance(e.cause, Exception) else e
                self._lose(index, f"{type(cause).__name__}: {cause}", cause)
            except RayActorError as e:
                self._lose(index, f"its agent died ({first_line(e)})", None)
            except GetTimeoutError:
                self._lose(index, f"its agent did not answer within {timeout:g} s", None)
        return answers

    def _lose(self, index: int, detail: str, cause: Exception | None) -> None:
        node = self.placement.nodes[index]
        if cause is None:
            self.cluster.forget(node.node_id)  # the next run on that node starts a new agent
        try:
            self.close()
        except Exception:
            pass
        if cause is not None and hasattr(cause, "_render_traceback_"):
            raise cause  # taas's own error from the node: it already says what happened
        raise RunLost(f"node {node.address} (node {index} of the run) was lost: {detail}")


def _sent(call: Callable[[], Any]) -> Any:
    """A call to an agent, or None when Ray cannot send it (the actor or the connection is gone)."""
    try:
        return call()
    except Exception:
        return None
