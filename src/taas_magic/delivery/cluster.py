"""Data delivery across a cluster's nodes: producers on CPU nodes, their elements relayed to the ranks.

    host node:  fork server ─ producers ──► channels, one per rank ──► agent (relays out)
                                                                            │ Ray calls: elements as bytes
    rank node:  agent (relays in) ──► channels, one per local rank ──► fork server's ranks (stand-ins)

Producers and stand-ins are the ones of a single machine (``producer.py``, ``standin.py``): the
same stream plan, seeding, order, ``--units``, window and errors. What differs is who holds the
other end of each channel. On a host node the agent holds every rank's end and hands what
arrives to whichever node pulls it; on a rank node the agent holds the producers' end of each of
its ranks' channels and puts in what it pulled. Each element is read once from the host's
channel and written once into the rank's, so it is still delivered exactly once.

Counters cannot be shared memory between machines, but each has one writer: every node keeps a
full copy and copies in the rows others own (``Counters.take_rows``). A rank node's pulls carry
its ranks' rows to the hosts, whose producers stay within the window of the slowest rank; the
kernel merges every node's copy into the progress line.

Everything here is made per run by the node's agent, except ``NodeShare`` (the kernel's word to
each agent) and ``NodeEnds.attach`` (in the run's supervisor, forked from the fork server).
"""

from __future__ import annotations

import dataclasses
import math
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from taas_magic.wire import memfile
from taas_magic.wire.events import Producer
from taas_magic.wire.records import DeliveryProgress
from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import StreamPlan
from taas_magic.delivery.producer import ProducerTask
from taas_magic.delivery.service import default_prefetch
from taas_magic.wire.task import LoaderPlan
from taas_magic.delivery.standin import StandIn
from taas_magic.delivery.transport import channel_pair, put, take_waiting

PULL_WAIT_SECONDS = 0.1  # how long a host waits for an element before answering a pull with none
PULL_BYTES = 64 * 1024**2  # the most one pull carries; more waits for the next
PULL_CALL_SECONDS = 60.0  # a host that does not answer a pull this soon is taken for gone


@dataclass(frozen=True)
class NodeShare:
    """One node's part in a run's data delivery, as the kernel assigns it (sent to the node's agent)."""

    run_id: str
    loaders: tuple[LoaderPlan, ...]
    world: int
    ranks: tuple[int, ...]  # the run's ranks on this node
    hosted: tuple[tuple[int, ...], ...]  # per loader: the producers that run on this node
    # Per loader: (agent, address) of each node that hosts its producers, for this node to pull from.
    sources: tuple[tuple[tuple[Any, str], ...], ...] = ()

    def active(self) -> bool:
        return any(self.hosted) or bool(self.ranks and self.loaders)


def shares(run_id: str, loaders: tuple[LoaderPlan, ...], ranks_by_node: list[tuple[int, ...]],
           hosts: int, agents: list[Any], addresses: list[str]) -> list[NodeShare]:
    """Each node's share: the run's nodes with ranks first, then ``hosts`` nodes for producers alone
    (``agents`` and ``addresses`` in that order).

    With host nodes, every producer has one to itself (the service's ``--cpus K``: K CPU nodes per
    loader); without, producers take turns on the rank nodes.
    """
    world = sum(len(ranks) for ranks in ranks_by_node)
    nodes = len(ranks_by_node) + hosts
    hosted: list[list[list[int]]] = [[[] for _ in loaders] for _ in range(nodes)]
    number = 0
    for index, plan in enumerate(loaders):
        for producer in range(plan.producers):
            node = len(ranks_by_node) + number if hosts else number % len(ranks_by_node)
            hosted[node][index].append(producer)
            number += 1
    sources = tuple(tuple((agents[node], addresses[node]) for node in range(nodes) if hosted[node][index])
                    for index in range(len(loaders)))
    every_node = list(ranks_by_node) + [()] * hosts
    return [NodeShare(run_id, loaders, world, every_node[node], tuple(map(tuple, hosted[node])),
                      sources if every_node[node] else ())
            for node in range(nodes)]


# -- in the run's supervisor on a node ----------------------------------------------------------
@dataclass(frozen=True)
class NodeEnds:
    """Which descriptor passed with the fork server's request is what (picklable; ``attach`` in the
    supervisor turns it into the service ``fork.ForkedRanks`` forks producers and ranks with)."""

    share: NodeShare
    counters: tuple[int, ...]  # per loader: the position of its counters' memory file
    producers_ends: tuple[tuple[int, ...], ...]  # per loader: positions of the producers' ends, by rank (hosts)
    rank_ends: tuple[tuple[int, ...], ...]  # per loader: positions of this node's ranks' ends, in rank order

    def fd_count(self) -> int:
        return len(self.counters) + sum(map(len, self.producers_ends)) + sum(map(len, self.rank_ends))

    def attach(self, fds: list[int], namespace: dict[str, Any]) -> "AttachedDelivery":
        return AttachedDelivery(self, fds, namespace)


class AttachedDelivery:
    """The data service of one node of a cluster run, as ``fork.ForkedRanks`` uses a local one."""

    def __init__(self, ends: NodeEnds, fds: list[int], namespace: dict[str, Any]):
        share = ends.share
        self.run_id = share.run_id
        self.share = share
        self.loaders = [namespace[plan.name] for plan in share.loaders]
        self.counters = []
        for plan, position in zip(share.loaders, ends.counters):
            self.counters.append(Counters(plan.producers, share.world, fds[position]))
            os.close(fds[position])  # the mapping stays, and forked processes inherit it
        self.producers_ends = [[socket.socket(fileno=fds[p]) for p in positions] for positions in ends.producers_ends]
        self.rank_ends = [dict(zip(share.ranks, (socket.socket(fileno=fds[p]) for p in positions)))
                          for positions in ends.rank_ends]

    def producers(self) -> list[tuple[Producer, ProducerTask]]:
        tasks = []
        for number, (plan, loader) in enumerate(zip(self.share.loaders, self.loaders)):
            prefetch = plan.prefetch or default_prefetch(self.share.world, plan.producers, loader.num_workers)
            for index in self.share.hosted[number]:
                task = ProducerTask(
                    name=plan.name, loader=loader, plan=StreamPlan(len(loader), self.share.world, plan.units),
                    index=index, count=plan.producers, window=max(1, math.ceil(prefetch / self.share.world)),
                    channels=self.producers_ends[number], counters=self.counters[number], seed=plan.seed,
                    reports_stats=False,  # the kernel makes the progress line from every node's counters
                    on_demand=plan.on_demand,
                )
                tasks.append((Producer(number, index), task))
        return tasks

    def producer_sockets(self, key: Producer) -> set[int]:
        return {end.fileno() for end in self.producers_ends[key.loader]}

    def rank_sockets(self, rank: int) -> set[int]:
        return {ends[rank].fileno() for ends in self.rank_ends}

    def rank_loaders(self) -> tuple["FedLoader", ...]:
        return tuple(FedLoader(plan, self.share.world, ends, counters)
                     for plan, ends, counters in zip(self.share.loaders, self.rank_ends, self.counters))

    def close(self) -> None:
        for ends in self.producers_ends:
            for end in ends:
                end.close()
        for by_rank in self.rank_ends:
            for end in by_rank.values():
                end.close()


@dataclass(frozen=True)
class FedLoader:
    """A rank's view of one loader fed by its node's agent: builds the stand-in inside the rank."""

    plan: LoaderPlan
    world: int
    ends: dict[int, socket.socket]
    counters: Counters

    @property
    def name(self) -> str:
        return self.plan.name

    def stand_in(self, rank: int, loader: Any, device: str) -> StandIn:
        return StandIn(self.name, loader, rank, StreamPlan(len(loader), self.world, self.plan.units),
                       self.ends[rank], self.counters, self.plan.fastest, device, reports=False)


# -- in a node's agent --------------------------------------------------------------------------
@dataclass
class _Loader:
    """One loader's channels and counters on this node."""

    counters_fd: int
    counters: Counters
    inbox: dict[int, socket.socket] = field(default_factory=dict)  # host: every rank's end, read by pulls
    outbox: dict[int, socket.socket] = field(default_factory=dict)  # rank node: producers' end of each local rank's
    handed: list[socket.socket] = field(default_factory=list)  # ends the fork server's processes get
    ended: set[int] = field(default_factory=set)  # ranks whose channel every producer has closed (hosts)


class NodeDelivery:
    """A node's agent's side of one run's delivery: the channels' far ends, pulls, feeding threads."""

    def __init__(self, share: NodeShare):
        self.share = share
        self.loaders: list[_Loader] = []
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []
        self.failure: str | None = None
        try:
            for number, plan in enumerate(share.loaders):
                self.loaders.append(self._loader(plan, bool(share.hosted[number])))
        except BaseException:
            self.close()
            raise

    def _loader(self, plan: LoaderPlan, hosts: bool) -> _Loader:
        fd = memfile.new_file("taas-counters", Counters.size(plan.producers, self.share.world))
        loader = _Loader(fd, Counters(plan.producers, self.share.world, fd))
        for rank in range(self.share.world) if hosts else ():
            producers_end, rank_end = channel_pair()
            loader.inbox[rank] = rank_end
            loader.handed.append(producers_end)
        for rank in self.share.ranks:
            producers_end, rank_end = channel_pair()
            producers_end.setblocking(False)  # a full channel must not stop the others' feeding
            loader.outbox[rank] = producers_end
            loader.handed.append(rank_end)
        return loader

    def ends(self) -> tuple[NodeEnds, list[int]]:
        """What the fork server's request carries: the layout, and the descriptors in its order."""
        fds: list[int] = []

        def place(items: Collection[int]) -> tuple[int, ...]:
            fds.extend(items)
            return tuple(range(len(fds) - len(items), len(fds)))

        counters, producers_ends, rank_ends = [], [], []
        for loader in self.loaders:
            counters.append(place([loader.counters_fd])[0])
            hosts = len(loader.inbox)
            producers_ends.append(place([end.fileno() for end in loader.handed[:hosts]]))
            rank_ends.append(place([end.fileno() for end in loader.handed[hosts:]]))
        share = dataclasses.replace(self.share, sources=())  # the agents' handles stay with the agent
        return NodeEnds(share, tuple(counters), tuple(producers_ends), tuple(rank_ends)), fds

    def handed_over(self) -> None:
        """The fork server has its copies: this process's are closed, so that a channel's end is seen
        when the processes at the other end are gone."""
        for loader in self.loaders:
            for end in loader.handed:
                end.close()
            loader.handed = []
            os.close(loader.counters_fd)
            loader.counters_fd = -1

    # -- a host: elements for a rank node's pull --------------------------------------------------
    def pull(self, number: int, ranks: tuple[int, ...], snapshot: list[int]) -> tuple[list[tuple[int, bytes, Any]], bool]:
        """Elements waiting for ``ranks`` (a rank node's), after taking in that node's counters; and
        whether every producer here is done with those ranks. Waits briefly when nothing is there."""
        import numpy  # Ray's own dependency: this runs in an agent
        loader = self.loaders[number]
        # A node's own ranks write their rows here themselves: a pull from this node's feeder carries
        # a copy that is already older.
        loader.counters.take_rows(snapshot, ranks=[rank for rank in ranks if rank not in self.share.ranks])
        deadline = time.monotonic() + PULL_WAIT_SECONDS
        elements: list[tuple[int, bytes, Any]] = []
        size = 0
        while True:
            open_ranks = [rank for rank in ranks if rank not in loader.ended]
            for rank in open_ranks:
                while size < PULL_BYTES and (taken := take_waiting(loader.inbox[rank])) is not None:
                    header, data = taken
                    if not header:
                        loader.ended.add(rank)
                        break
                    # An array over the element's mapping: Ray copies it into its object store once,
                    # and the rank node reads it there without another copy.
                    elements.append((rank, header, numpy.frombuffer(data, dtype=numpy.uint8)))
                    size += len(data)
            ended = all(rank in loader.ended for rank in ranks)
            left = deadline - time.monotonic()
            if elements or ended or left <= 0:
                return elements, ended
            select.select([loader.inbox[rank] for rank in open_ranks], [], [], left)

    # -- a rank node: pulling from the hosts --------------------------------------------------------
    def start_feeding(self, get: Callable[[Any, float], Any]) -> None:
        """A thread per loader pulls this node's elements from the hosts (``get`` is ``ray.get``)."""
        if not self.share.ranks:
            return
        for number in range(len(self.loaders)):
            thread = threading.Thread(target=self._feed, args=(number, get), name=f"taas-feed-{number}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def _feed(self, number: int, get: Callable[[Any, float], Any]) -> None:
        """Pull from every host of loader ``number`` and put what comes into the ranks' channels.

        Each host always has the next pull in flight while this thread puts what the last one
        brought, so the relay keeps going while the ranks read. Once every rank of this node is
        done, the pulls in flight come back, one more round carries that news to the hosts (their
        producers stop waiting for these ranks), and the thread ends.
        """
        loader = self.loaders[number]
        waiting: dict[int, list[tuple[bytes, Any]]] = {rank: [] for rank in self.share.ranks}
        calls = {source: self._pull(source, number) for source in self.share.sources[number]}
        rounds_left: int | None = None  # once this node's ranks are all done
        try:
            while calls and rounds_left != 0 and not self.stopped.is_set():
                for source, call in list(calls.items()):
                    try:
                        elements, ended = get(call, PULL_CALL_SECONDS)
                    except Exception as e:  # the kernel sees the host gone too, and ends the run
                        self.failure = (f"node {source[1]}, which hosts producers of {self.share.loaders[number].name}, "
                                        f"did not answer: {_first_line(e)}")
                        return
                    for rank, header, data in elements:
                        waiting[rank].append((header, data))
                    if ended or rounds_left == 1:
                        del calls[source]
                    else:
                        calls[source] = self._pull(source, number)
                _put_waiting(loader.outbox, waiting)
                if rounds_left is None and all(loader.counters.is_done(rank) for rank in self.share.ranks):
                    rounds_left = 2
                elif rounds_left is not None:
                    rounds_left -= 1
            while any(waiting.values()) and not self.stopped.wait(0.01):
                _put_waiting(loader.outbox, waiting)
        finally:
            for end in loader.outbox.values():
                end.close()  # every producer is done: a rank waiting for more is told so (EOFError)

    def _pull(self, source: tuple[Any, str], number: int) -> Any:
        """Ask a host for this node's elements, with this node's counters as they are now."""
        snapshot = self.loaders[number].counters.snapshot()
        return source[0].pull.remote(self.share.run_id, number, self.share.ranks, snapshot)

    def snapshots(self) -> list[list[int]]:
        return [loader.counters.snapshot() for loader in self.loaders]

    def close(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(1.0)  # a thread still waiting for a pull finds its channels closed and ends
        for loader in self.loaders:
            for end in [*loader.inbox.values(), *loader.outbox.values(), *loader.handed]:
                end.close()
            if loader.counters_fd >= 0:
                os.close(loader.counters_fd)
                loader.counters_fd = -1


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _put_waiting(outbox: dict[int, socket.socket], waiting: dict[int, list[tuple[bytes, Any]]]) -> None:
    """Into each rank's channel, what it can take now, in order; a rank that has left takes nothing."""
    for rank, elements in waiting.items():
        while elements:
            try:
                put(outbox[rank], *elements[0])
            except BlockingIOError:
                break
            except OSError:  # the rank is gone
                elements.clear()
                break
            elements.pop(0)


# -- in the kernel --------------------------------------------------------------------------------
class RunProgress:
    """The progress line of a cluster run: every node's copy of the counters merged by who writes what."""

    def __init__(self, shares_by_node: list[NodeShare]):
        first = shares_by_node[0]
        self.shares = shares_by_node
        self.loaders = first.loaders
        self.counters = [Counters(plan.producers, first.world) for plan in first.loaders]
        self.shown: list[DeliveryProgress | None] = [None] * len(first.loaders)

    def take(self, node: int, snapshots: list[list[int]]) -> list[tuple[Producer, DeliveryProgress]]:
        """Merge one node's copies; (key, progress) of each loader whose line changed."""
        share = self.shares[node]
        changed = []
        for number, snapshot in enumerate(snapshots):
            self.counters[number].take_rows(snapshot, producers=share.hosted[number], ranks=share.ranks)
            stats = self.counters[number].stats(self.loaders[number].name)
            shown = self.shown[number]
            if shown is None or _differs(stats, shown):
                self.shown[number] = stats
                changed.append((Producer(number, 0), stats))
        return changed


def _differs(a: DeliveryProgress, b: DeliveryProgress) -> bool:
    return (a.produced, a.taken, a.skipped, a.buffered, a.done) != (b.produced, b.taken, b.skipped, b.buffered, b.done)
