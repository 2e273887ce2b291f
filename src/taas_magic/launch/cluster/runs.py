"""In the cluster driver: a run's ranks on several nodes of a Ray cluster.

    driver ── Ray ──► placement group (one whole node per bundle)
                      ├─ node 0: agent ─ fork server ─ ranks 0..k-1   (serves the run's TCPStore)
                      ├─ node 1: agent ─ fork server ─ ranks k..2k-1
                      └─ c1.4 nodes, when the cell uses registered loaders: agent ─ fork server ─ producers
                         (each rank node's agent pulls its ranks' batches from them: delivery/cluster.py)

The payload (the task and the names the cell reads, tensor data included) goes into Ray's object
store once; each node's agent fetches it once for all its ranks. The driver polls every node's
agent for events in parallel; a node or agent that dies turns into a cell error naming it, and
the other nodes' ranks are stopped. Closing a run ends every node's share, releases the nodes and
answers with what rank 0 wrote, for the kernel to copy into the notebook's folder.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from taas_magic.delivery.cluster_share import NodeShare, RunProgress, shares
from taas_magic.errors import RunLost, TaasUsageError, first_line
from taas_magic.launch.cluster import growth, notebook_folder, traces
from taas_magic.launch.cluster.agent import NodePayload, RunFiles
from taas_magic.launch.cluster.connection import Cluster, Placement, ray_module
from taas_magic.launch.cluster.nodes import Node
from taas_magic.launch.supervisor.handle import CLOSE_SECONDS
from taas_magic.per_rank import span
from taas_magic.process import containment
from taas_magic.wire.cluster_driver import StartOnNodes
from taas_magic.wire.events import NODE_LOST, Event, Exited, Key, Producer, Report, key_order
from taas_magic.wire.rank_control import PULL_KEY, PULL_TOGETHER, SessionCell, pull_request, world_variables

CALL_SECONDS = 15.0  # the longest an agent may take to answer beyond what was asked of it
START_SECONDS = 150.0  # a cold agent imports torch before its ranks start


def start(
    cluster: Cluster,
    request: StartOnNodes,
    payload: object,
    folder: notebook_folder.Listing,
    notify: Callable[[str], object] = lambda line: None,
    joining: NodePayload | None = None,
) -> "ClusterRanks":
    """The run ``request`` asks for, started on its nodes over ``payload`` (a reference in Ray's object store),
    with the notebook's ``folder`` as it travelled; ``notify`` tells the notebook a line (a session's lost node);
    ``joining``: a session's task and folder without its names, for ranks that join it (``grow``)."""
    producers = sum(loader.producers for loader in request.loaders)
    placement = cluster.place(request.configuration, request.nodes, producers, request.producer_node)
    try:
        agents = cluster.agents_on(placement.nodes, request.versions)
    except BaseException:
        placement.release()
        raise
    per_node = _on_nodes(request.envs, placement.nodes)
    node_shares = (
        shares(
            request.run_id,
            request.loaders,
            [tuple(sorted(node)) for node in per_node[: request.nodes]],
            placement.hosts,
            agents,
            [node.address for node in placement.nodes],
        )
        if request.loaders
        else None
    )
    joiners = growth.Joiners(request.run_id, request.versions, joining, request.configuration) if joining else None
    group = ClusterRanks(
        cluster, placement, agents, node_shares, request.profile, folder, request.keep, notify, joiners
    )
    try:
        group.start(request.run_id, per_node, payload)
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


class ClusterRanks:
    """A run spread over nodes, as the driver drives it for the kernel (the RankGroup contract, but that
    ``close`` answers with rank 0's files)."""

    def __init__(
        self,
        cluster: Cluster,
        placement: Placement,
        agents: list[Any],
        shares: list[NodeShare] | None = None,
        profile: str | None = None,
        folder: notebook_folder.Listing | None = None,
        keep: bool = False,
        notify: Callable[[str], object] = lambda line: None,
        joiners: growth.Joiners | None = None,
    ):
        self.cluster = cluster
        self.placement = placement
        self.agents = agents  # in node-rank order, then the nodes that host producers alone
        self.shares = shares  # each node's part in data delivery, when the cell uses registered loaders
        # Each share's progress line, by the number of its first loader: the run's, then those of the loaders a
        # session began to serve since.
        self.progress: dict[int, RunProgress] = {0: RunProgress(shares)} if shares else {}
        self.alive: list[set[Key]] = [set() for _ in agents]
        self.profile = profile  # the running cell's --profile folder on this machine: where the nodes' traces go
        self.closed: RunFiles | None = None
        self.folder = folder  # the notebook's folder as it travelled with the run
        self.told = ""  # the folder's fingerprint when a session's cell last said it changed
        self.keep = keep  # a session: it goes on without a lost node but node 0 (which serves the run's store)
        self.joiners = joiners  # a session's, for the ranks a resize adds
        self.notify = notify
        self.ranks_on: list[frozenset[int]] = [frozenset() for _ in agents]  # each node's ranks, once started
        self.lost: list[Event] = []  # the exits of a lost node's ranks, not handed out yet
        self.envs: dict[int, dict[str, str]] = {}  # every rank's environment as it started, for ``grow``
        self.added: list[Placement] = []  # the placement groups of the nodes a session's resizes added
        self.gone: set[str] = set()  # the ids of the nodes it lost: Ray may still count one as alive a while

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
        self.ranks_on = [frozenset(node) for node in envs] + self.ranks_on[len(envs) :]
        self.envs = {rank: env for node in envs for rank, env in node.items()}

    def nodes(self) -> frozenset[str]:
        return frozenset(node.node_id for node in self.placement.nodes)

    def running(self) -> set[Key]:
        return set().union(*self.alive)

    def events(self, timeout: float) -> list[Event]:
        live = [index for index, keys in enumerate(self.alive) if keys]
        answers = self._call(live, lambda index: self.agents[index].events.remote(timeout), timeout + CALL_SECONDS)
        events: list[Event] = []
        for index, answer in zip(live, answers):
            if answer is None:
                continue  # its node was lost: its ranks' exits follow
            events += answer.events
            self.alive[index] = set(answer.running)
            traces.write_into(self.profile, answer.traces)
            for first, progress, snapshots in self._by_share(answer.snapshots):
                taken = progress.take(index, snapshots)
                events += [Report(Producer(first + key.loader, key.index), record) for key, record in taken]
        events, self.lost = events + self.lost, []
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

    def run_cell(self, cell: SessionCell, ranks: Iterable[int], tensors: bytes) -> None:
        """A session's next cell, to the nodes of ``ranks``: each node's ranks among them, a rank that died there
        included (the cell names it among its newcomers, for the node's supervisor to start a new process in its
        place); its tensors travel once, through Ray's object store."""
        chosen = set(ranks)
        self.profile = cell.order.profile
        shared = ray_module().put(tensors)
        on_node = [chosen & (self.ranks_on[index] | self.alive[index]) for index in range(len(self.agents))]
        # A resize's goes to the nodes whose ranks leave too: their supervisors end them.
        leaving = [any(cell.leaves(rank) for rank in self.ranks_on[index]) for index in range(len(self.agents))]
        live = [index for index, keys in enumerate(on_node) if keys or leaving[index]]
        merged = self._merged_counters() if cell.newcomers and cell.world is None else None
        new_shares = self._new_shares(cell)
        if new_shares:  # a node that hosts the new loaders' producers alone gets the cell too
            live = sorted(set(live) | {index for index, share in enumerate(new_shares) if share.active()})
        self._call(
            live,
            lambda index: self.agents[index].run_cell.remote(
                cell,
                sorted(key for key in on_node[index] if isinstance(key, int)),
                shared,
                merged if set(cell.newcomers) & self.ranks_on[index] else None,
                new_shares[index] if new_shares else None,
            ),
            CALL_SECONDS,
        )
        for index in [index for index in live if self.ranks_on[index]]:  # not lost meanwhile: as its supervisor
            # does, so that the next events ask every node that has ranks
            self.alive[index] = cell.alive_after(self.alive[index], on_node[index])
            self.ranks_on[index] = frozenset(rank for rank in self.ranks_on[index] if not cell.leaves(rank))
        while self.added and not any(self.ranks_on[self._first_added() :]):  # a shrink emptied the nodes it added
            self._let_go_of_last_added()

    def _new_shares(self, cell: SessionCell) -> list[NodeShare] | None:
        """Each node's part in serving the loaders a session's cell begins to serve (registered since it started):
        producers on the nodes that host the session's producers, or taking turns on the nodes of its ranks, as
        for the session's first loaders; None when it begins to serve none."""
        if not cell.order.loaders or self.joiners is None:
            return None
        first = cell.first_loader
        rank_nodes = self._rank_nodes()
        made = shares(
            f"{self.joiners.run_id}/{first}",
            cell.order.loaders,
            [tuple(sorted(ranks)) for ranks in self.ranks_on[:rank_nodes]],
            self.placement.hosts,
            self.agents,
            [node.address for node in self.placement.nodes],
            first=first,
        )
        self.progress[first] = RunProgress(made)
        return made

    def _merged_counters(self) -> dict[int, list[list[int]]] | None:
        """Every node's counters of the registered loaders a session serves, merged now (its ranks stopped, the
        producers waiting for the dead ranks): what the nodes of new processes in place of dead ranks copy in, for
        them to take over their shares (by share). None when the session serves none."""
        if not self.progress:
            return None
        asked = [index for index in range(len(self.agents)) if self.alive[index] or self.ranks_on[index]]
        for index, answer in zip(asked, self._call(asked, lambda i: self.agents[i].counters.remote(), CALL_SECONDS)):
            for _, progress, snapshots in self._by_share(answer or {}):
                progress.merge(index, snapshots)
        return {first: progress.snapshots() for first, progress in self.progress.items()}

    def _by_share(self, answer: dict[int, list[list[int]]]) -> list[tuple[int, RunProgress, list[list[int]]]]:
        """A node's counters, as its agent answers them by share: each with the share's first loader's number and
        progress line (a share the kernel does not know of yet, or an empty copy, left out)."""
        known = [(first, snapshots) for first, snapshots in answer.items() if first in self.progress and snapshots]
        return [(first, self.progress[first], snapshots) for first, snapshots in known]

    def grow(self, world: int, nodes: int) -> None:
        """``%taas resize`` to ``world`` ranks on ``nodes`` nodes: the new ranks start on the nodes the session's
        placement groups hold for them first (one a resize emptied, or the node Ray placed there after one was lost),
        then on nodes a placement group of their own adds (``growth.py``), as ranks that join it
        (``RankTask.joins``), and wait for the resize's cell, which heals them. Refused in one line, before any
        starts, where the cluster has no such node now; a failure to start them lets go of what the resize took."""
        sizes, per_node, held = world_variables(world, nodes), world // nodes, self._rank_nodes()
        wanted: dict[int, dict[int, dict[str, str]]] = {}  # node index -> its new ranks' environments
        for rank in range(world):
            if not any(rank in ranks for ranks in self.ranks_on):
                env = {**growth.environment(self.envs, rank, per_node), **sizes}
                wanted.setdefault(int(env["GROUP_RANK"]), {})[rank] = env
        holding = [self.placement, *self.added]
        placed = {i: growth.node_for(self.cluster, holding, i, self.gone) for i in sorted(wanted) if i < held}
        placed |= self._hold_more(nodes - held) if nodes > held else {}
        started: list[int] = []
        try:
            for index, node in placed.items():
                started.append(index)
                self._start_joining(index, node, wanted[index])
        except BaseException:
            for index in [index for index in started if index < held]:  # none of the resize's ranks stay
                _sent(lambda: ray_module().get(self.agents[index].close.remote(False), timeout=CLOSE_SECONDS))
                self.alive[index], self.ranks_on[index] = set(), frozenset()
            if nodes > held:
                self._let_go_of_last_added()
            raise
        self.envs |= {rank: env for envs in wanted.values() for rank, env in envs.items()}

    def _rank_nodes(self) -> int:
        """How many nodes the session holds for ranks, with ranks on them or not."""
        return len(self.placement.nodes) - self.placement.hosts

    def _hold_more(self, count: int) -> dict[int, Node]:
        """``count`` nodes more for the session, by the index each gets: a placement group of their own."""
        assert self.joiners is not None  # a session's: a one-shot run is never resized
        if self.placement.hosts:  # never: it serves registered loaders, and the kernel refuses to resize it
            raise TaasUsageError("the session holds nodes for data producers, and grows onto no other node")
        held = self._rank_nodes()
        more = growth.place_more(self.cluster, self.joiners.configuration, held, count, self.gone)
        self.added.append(more)
        return {held + offset: node for offset, node in enumerate(more.nodes)}

    def _first_added(self) -> int:
        """The index of the first node of the last placement group a resize added."""
        first_group = len(self.placement.bundles) - self.placement.hosts
        return first_group + sum(len(added.bundles) for added in self.added[:-1])

    def _let_go_of_last_added(self) -> None:
        """The nodes of the last placement group a resize added go back to the cluster, whatever of the session's
        ran there ended: a resize that emptied them, or one that failed to start its ranks there. Those of the
        group the session started with stay held (Ray cannot make a placement group smaller)."""
        first = self._first_added()
        for agent in self.agents[first:]:
            _sent(lambda: ray_module().get(agent.close.remote(False), timeout=CLOSE_SECONDS))
        del self.agents[first:], self.alive[first:], self.ranks_on[first:], self.placement.nodes[first:]
        self.added.pop().release()

    def _start_joining(self, index: int, node: Node, envs: dict[int, dict[str, str]]) -> None:
        """Ranks ``envs`` on ``node``, as node ``index`` of the session, to join it with the next cell."""
        joiners = self.joiners
        assert joiners is not None
        try:
            (agent,) = self.cluster.agents_on([node], joiners.versions)
        except TaasUsageError:
            raise
        except Exception as e:  # the node went since Ray last said it was there
            self.gone.add(node.node_id)
            raise TaasUsageError(f"node {index} of the session, {node.address}, is gone ({first_line(e)})") from None
        if index == len(self.agents):  # a node the resize added
            self.agents.append(agent)
            self.placement.nodes.append(node)
            self.alive.append(set())
            self.ranks_on.append(frozenset())
        else:
            self.agents[index], self.placement.nodes[index] = agent, node
        try:
            started = agent.start.remote(joiners.run_id, envs, joiners.payload, None)
            keys = ray_module().get(started, timeout=START_SECONDS)
        except Exception as e:
            raise TaasUsageError(
                f"the new ranks could not start on node {index} of the session, {node.address} ({first_line(e)})"
            ) from None
        self.alive[index], self.ranks_on[index] = set(keys), frozenset(envs)

    def ask_pull(self, number: int, names: tuple[str, ...], ranks: tuple[int, ...]) -> bool:
        """`%taas pull` while a session's cell runs: node 0's supervisor puts the request in the run's store and says
        when it is there, then every node tells its asked ranks (``rank/pulling.py``)."""
        put = self._call(
            [0],
            lambda index: self.agents[index].put_in_store.remote(PULL_KEY, pull_request(number, names, ranks)),
            CALL_SECONDS,
        )
        if not put or not put[0]:
            return False
        self.signal(PULL_TOGETHER, ranks)
        return True

    def tell_if_the_folder_changed(self, folder: str, notify: Callable[[str], object]) -> None:
        """A session's ranks keep the notebook's files they started with: an edit of ``folder`` since then is
        said once, not silently ignored."""
        if self.folder is None:
            return
        try:
            now = notebook_folder.listing(folder)
        except (OSError, TaasUsageError):  # the folder went, or cannot be read: the ranks have theirs
            return
        changed = now.changed_since(self.folder)
        if changed and now.fingerprint() != self.told:
            self.told = now.fingerprint()
            notify(notebook_folder.news_of_changes(changed))

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
            stacks.update(answer or {})
        return stacks

    def close(self) -> RunFiles:
        """End every node's share of the run and release the nodes; rank 0's files. An interrupt meanwhile
        is raised once all is closed (the files are then kept for the next ``close``)."""
        if self.closed is not None:
            return self.closed
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
                    files = dataclasses.replace(answer, node=self.placement.nodes[0].address)
        finally:
            self.alive = [set() for _ in self.agents]
            self.closed = files
            for placement in (self.placement, *self.added):
                try:
                    placement.release()
                except Exception:
                    pass  # the cluster is gone, and its placement groups with it
        if interrupted:
            raise KeyboardInterrupt
        return files

    # -- calls to the agents ------------------------------------------------------------------
    def _call(self, indexes: list[int], request: Callable[[int], Any], timeout: float) -> list[Any]:
        refs = []
        for index in indexes:
            try:
                refs.append(request(index))
            except Exception as e:  # Ray could not even send it: the agent's actor, or the connection, is gone
                self.cluster.forget(self.placement.nodes[index].node_id)
                self._lost(index, f"its agent cannot be reached ({first_line(e)})")
                refs.append(None)
        return self._wait(indexes, refs, timeout)

    def _wait(self, indexes: list[int], refs: list[Any], timeout: float) -> list[Any]:
        """The agents' answers (None for a node lost meanwhile that a session goes on without); a node that died
        or does not answer ends the whole run, or else a session loses its ranks (``_lost``)."""
        ray = ray_module()
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        answers = []
        for index, ref in zip(indexes, refs):
            answer = None
            try:
                answer = ray.get(ref, timeout=timeout) if ref is not None else None
            except RayTaskError as e:  # the agent raised: its own run was lost, or could not start
                cause = e.cause if isinstance(e.cause, Exception) else e
                self._lose(index, f"{type(cause).__name__}: {cause}", cause)
            except RayActorError as e:
                self._lost(index, f"its agent died ({first_line(e)})")
            except GetTimeoutError:
                self._lost(index, f"its agent did not answer within {timeout:g} s")
            answers.append(answer)
        return answers

    def _lost(self, index: int, detail: str) -> None:
        """Node ``index`` is gone or does not answer. A session goes on without it when it held ranks but not
        node 0's (the run's store is there) and serves no loader (the node's share of the data would be lost):
        its agent is ended (with it, whatever of the node's still runs), and each of its ranks is said to have
        exited ``NODE_LOST``. Else the run ends (``_lose``)."""
        ranks = sorted(self.ranks_on[index]) if index < len(self.ranks_on) else []
        if not (self.keep and index > 0 and ranks and not self.progress):
            self._lose(index, detail + self._why_the_session_cannot_go_on(index, ranks), None)
        node = self.placement.nodes[index]
        self.cluster.forget(node.node_id)
        self.gone.add(node.node_id)
        try:
            ray_module().kill(self.agents[index])
        except Exception:
            pass  # gone with its node
        self.alive[index], self.ranks_on[index] = set(), frozenset()
        self.lost += [Exited(rank, NODE_LOST) for rank in ranks]
        self.notify(
            f"taas: node {node.address} (node {index} of the run) was lost: {detail}; the session goes on without "
            f"its ranks ({span(ranks)})"
        )

    def _why_the_session_cannot_go_on(self, index: int, ranks: list[int]) -> str:
        """What a session's notice of a lost node adds: why the session ends with it ('' for a one-shot run)."""
        if not self.keep:
            return ""
        if index == 0:
            return "; node 0 serves the run's store, and the session cannot go on without it"
        if self.progress:
            return "; the session serves registered loaders, and cannot go on without the node's share"
        return "" if ranks else "; it held none of the session's ranks any more"

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
