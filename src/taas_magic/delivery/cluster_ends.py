"""Data delivery across a cluster, in the run's supervisor on a node and in its ranks: which descriptor
that came with the fork server's request is what (``NodeEnds``), the producers and stand-ins made of
them (``AttachedDelivery``, ``FedLoader``), as a local run's data service makes its own.

``cluster.py`` says how the nodes feed one another.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from dataclasses import dataclass
from typing import Any

from taas_magic.delivery.cluster_share import NodeShare
from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import StreamPlan
from taas_magic.delivery.producer import ProducerTask
from taas_magic.delivery.service import default_prefetch, take_over
from taas_magic.delivery.standin import StandIn
from taas_magic.wire.events import Producer
from taas_magic.wire.task import LoaderPlan


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
        self.counters_fds = [fds[position] for position in ends.counters]  # for ranks that run already (late_ends)
        for plan, fd in zip(share.loaders, self.counters_fds):
            self.counters.append(Counters(plan.producers, share.world, fd))
        self.producers_ends = [[socket.socket(fileno=fds[p]) for p in positions] for positions in ends.producers_ends]
        self.rank_ends = [
            dict(zip(share.ranks, (socket.socket(fileno=fds[p]) for p in positions))) for positions in ends.rank_ends
        ]

    def producers(self) -> list[tuple[Producer, ProducerTask]]:
        tasks = []
        for number, (plan, loader) in enumerate(zip(self.share.loaders, self.loaders)):
            prefetch = plan.prefetch or default_prefetch(self.share.world, plan.producers, loader.num_workers)
            for index in self.share.hosted[number]:
                task = ProducerTask(
                    name=plan.name,
                    loader=loader,
                    plan=StreamPlan(len(loader), self.share.world, plan.units),
                    index=index,
                    count=plan.producers,
                    window=max(1, math.ceil(prefetch / self.share.world)),
                    channels=self.producers_ends[number],
                    counters=self.counters[number],
                    seed=plan.seed,
                    reports_stats=False,  # the kernel makes the progress line from every node's counters
                    on_demand=plan.on_demand,
                )
                tasks.append((Producer(self.share.first + number, index), task))
        return tasks

    def producer_sockets(self, key: Producer) -> set[int]:
        return {end.fileno() for end in self.producers_ends[key.loader - self.share.first]}

    def rank_sockets(self, rank: int) -> set[int]:
        return {ends[rank].fileno() for ends in self.rank_ends}

    def rank_loaders(self) -> tuple["FedLoader", ...]:
        return tuple(
            FedLoader(plan, self.share.world, ends, counters)
            for plan, ends, counters in zip(self.share.loaders, self.rank_ends, self.counters)
        )

    def late_ends(self, rank: int) -> tuple[int, ...]:
        """For a rank that runs already, which begins to take these loaders with a cell: its end of each loader's
        channel, then each loader's counters file (``service.late_stand_ins`` takes them in that order)."""
        return tuple(ends[rank].fileno() for ends in self.rank_ends) + tuple(self.counters_fds)

    def for_replacement(self, rank: int) -> tuple[set[int], tuple["FedLoader", ...]]:
        """What a session's new process in place of ``rank`` keeps (its ends, which this supervisor kept open: what
        was sent the rank that died waits there), and what builds its stand-ins, which take over its share."""
        loaders = tuple(dataclasses.replace(loader, replaces=True) for loader in self.rank_loaders())
        return self.rank_sockets(rank), loaders

    def sockets(self) -> set[int]:
        """The ranks' ends this process keeps for a session's new processes."""
        return {end.fileno() for by_rank in self.rank_ends for end in by_rank.values() if end.fileno() >= 0}

    def close(self, keep_rank_ends: bool = False) -> None:
        """This process's copies of the channels; the producers and ranks keep theirs. ``keep_rank_ends``: but the
        ranks' ends, for a session's rank started in place of one that died."""
        for ends in self.producers_ends:
            for end in ends:
                end.close()
        for by_rank in self.rank_ends if not keep_rank_ends else ():
            for end in by_rank.values():
                end.close()
        for fd in self.counters_fds:  # the mappings stay, and forked processes inherit them
            os.close(fd)
        self.counters_fds = []


@dataclass(frozen=True)
class FedLoader:
    """A rank's view of one loader fed by its node's agent: builds the stand-in inside the rank."""

    plan: LoaderPlan
    world: int
    ends: dict[int, socket.socket]
    counters: Counters
    replaces: bool = False  # in a new process in place of a rank that died: it takes over that rank's share

    @property
    def name(self) -> str:
        return self.plan.name

    def stand_in(self, rank: int, loader: Any, device: str) -> StandIn:
        stream = StreamPlan(len(loader), self.world, self.plan.units)
        stand_in = StandIn(
            self.name, loader, rank, stream, self.ends[rank], self.counters, self.plan.fastest, device, reports=False
        )
        if self.replaces:  # the node's counters hold every node's rows, copied in before it started
            take_over(stand_in, rank, loader, stream, self.plan.seed)
        return stand_in
