"""Data delivery across a cluster, in the kernel: each node's share of a run's delivery (``NodeShare``,
sent to the node's agent) and the run's progress line, merged from every node's counters.

``cluster.py`` says how the nodes feed one another.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from taas_magic.delivery.counters import Counters
from taas_magic.wire.events import Producer
from taas_magic.wire.records import DeliveryProgress
from taas_magic.wire.task import LoaderPlan


@dataclass(frozen=True)
class NodeShare:
    """One node's part in a run's data delivery, as the kernel assigns it (sent to the node's agent)."""

    run_id: str
    loaders: tuple[LoaderPlan, ...]
    world: int
    ranks: tuple[int, ...]  # the run's ranks on this node
    hosted: tuple[tuple[int, ...], ...]  # per loader: the producers that run on this node
    # Per loader: (agent, address) of each node that hosts its producers, for this node to read from.
    sources: tuple[tuple[tuple[Any, str], ...], ...] = ()
    secret: bytes = b""  # the run's, proven by both ends of every stream between nodes
    listen: str = ""  # where a host accepts streams: loopback when its only reader is itself
    first: int = 0  # the session's number of its first loader: a session's later shares serve loaders after it

    def active(self) -> bool:
        return any(self.hosted) or bool(self.ranks and self.loaders)


def shares(
    run_id: str,
    loaders: tuple[LoaderPlan, ...],
    ranks_by_node: list[tuple[int, ...]],
    hosts: int,
    agents: list[Any],
    addresses: list[str],
    first: int = 0,
) -> list[NodeShare]:
    """Each node's share: the run's nodes with ranks first, then ``hosts`` nodes for producers alone
    (``agents`` and ``addresses`` in that order).

    With host nodes, every producer has one to itself (the service's ``--cpus K``: K CPU nodes per
    loader), or takes turns on them with more producers than nodes (a session's loaders registered since it
    started: numbered from ``first``); without, producers take turns on the rank nodes.
    """
    world = sum(len(ranks) for ranks in ranks_by_node)
    nodes = len(ranks_by_node) + hosts
    hosted: list[list[list[int]]] = [[[] for _ in loaders] for _ in range(nodes)]
    number = 0
    with_ranks = [node for node, ranks in enumerate(ranks_by_node) if ranks]  # a session's may have lost some
    for index, plan in enumerate(loaders):
        for producer in range(plan.producers):
            node = len(ranks_by_node) + number % hosts if hosts else with_ranks[number % len(with_ranks)]
            hosted[node][index].append(producer)
            number += 1
    sources = tuple(
        tuple((agents[node], addresses[node]) for node in range(nodes) if hosted[node][index])
        for index in range(len(loaders))
    )
    every_node = list(ranks_by_node) + [()] * hosts
    secret = secrets.token_bytes(32)
    return [
        NodeShare(
            run_id,
            loaders,
            world,
            every_node[node],
            tuple(map(tuple, hosted[node])),
            sources if every_node[node] else (),
            secret,
            _listen(node, hosted[node], addresses, len(ranks_by_node)),
            first,
        )
        for node in range(nodes)
    ]


def _listen(node: int, hosted: list[list[int]], addresses: list[str], rank_nodes: int) -> str:
    """Where a host accepts its readers: nowhere if it hosts nothing, on loopback if every node of
    ranks is this one, else on the node's address (the only one the others know it by)."""
    if not any(hosted):
        return ""
    return "127.0.0.1" if all(addresses[n] == addresses[node] for n in range(rank_nodes)) else addresses[node]


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
        self.merge(node, snapshots)
        changed = []
        for number in range(len(snapshots)):
            stats = self.counters[number].stats(self.loaders[number].name)
            shown = self.shown[number]
            if shown is None or _differs(stats, shown):
                self.shown[number] = stats
                changed.append((Producer(number, 0), stats))
        return changed

    def merge(self, node: int, snapshots: list[list[int]]) -> None:
        """Copy in the rows node ``node`` writes (its producers', its ranks') from its copies."""
        share = self.shares[node]
        for number, snapshot in enumerate(snapshots):
            self.counters[number].take_rows(snapshot, producers=share.hosted[number], ranks=share.ranks)

    def snapshots(self) -> list[list[int]]:
        """Every loader's counters as merged so far."""
        return [counters.snapshot() for counters in self.counters]


def _differs(a: DeliveryProgress, b: DeliveryProgress) -> bool:
    return (a.produced, a.taken, a.skipped, a.buffered, a.done) != (b.produced, b.taken, b.skipped, b.buffered, b.done)
