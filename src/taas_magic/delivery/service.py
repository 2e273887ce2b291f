"""The producers' side of a run, in the run's supervisor, which forks the producers and the ranks.

For each registered loader the cell uses: one channel per rank, shared counters, and the
tasks of its K producers. Built before anything is forked, so producers and ranks inherit
their ends; this process closes its copies once they have. A session also serves loaders
registered while it runs: their ranks exist already, and get their ends with a cell.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import StreamPlan
from taas_magic.delivery.producer import ProducerTask, rebuild
from taas_magic.delivery.standin import StandIn, next_pass
from taas_magic.delivery.transport import channel_pair
from taas_magic.wire import memfile
from taas_magic.wire.events import Key, Producer
from taas_magic.wire.task import LoaderPlan


def producer_labels(plans: tuple[LoaderPlan, ...], first: int = 0) -> dict[Key, str]:
    """``first``: the number of the first of ``plans`` among the run's loaders (a session adds loaders)."""
    return {
        Producer(first + n, j): f"producer {j} of {plan.name}"
        for n, plan in enumerate(plans)
        for j in range(plan.producers)
    }


def default_prefetch(world: int, producers: int, num_workers: int) -> int:
    """Enough elements in flight to keep every producer (and its workers) busy, and no more."""
    return max(8, 4 * world, 4 * producers * max(1, num_workers))


@dataclass
class _LoaderRuntime:
    plan: LoaderPlan
    loader: Any
    stream: StreamPlan
    channels: list[tuple[Any, Any]]  # (producers' end, rank's end) per rank
    counters: Counters
    window: int
    seed: int
    counters_fd: int | None = None  # the counters' memory file, for ranks that are running already


@dataclass(frozen=True)
class RankLoader:
    """A rank's view of one loader's delivery: builds its stand-in inside the rank. ``replaces``: the rank is a
    new process in place of one that died, and takes over its share of the stream (``StandIn.take_over``)."""

    runtime: _LoaderRuntime
    replaces: bool = False

    @property
    def plan(self) -> LoaderPlan:
        return self.runtime.plan

    @property
    def name(self) -> str:
        return self.runtime.plan.name

    def stand_in(self, rank: int, loader: Any, device: str) -> StandIn:
        runtime = self.runtime
        stand_in = StandIn(
            self.name,
            loader,
            rank,
            runtime.stream,
            runtime.channels[rank][1],
            runtime.counters,
            runtime.plan.fastest,
            device,
        )
        if self.replaces:
            take_over(stand_in, rank, runtime.loader, runtime.stream, runtime.seed)
        return stand_in


def take_over(stand_in: StandIn, rank: int, loader: Any, stream: StreamPlan, seed: int) -> None:
    """In a new process in place of rank ``rank``, which died: its share of the stream, the elements the dead
    process had received built again as the producers built them (from ``loader`` and the run's ``seed``); the
    cell says what it did."""
    said = stand_in.take_over(lambda lost: rebuild(loader, stream, seed, lost))
    print(f"taas: rank {rank}: {said}", file=sys.stderr, flush=True)


class DataService:
    """``first``: the number of the first of ``plans`` among the run's loaders. A session adds loaders
    while its ranks run (``late``): their counters are then in memory files the ranks map, and the
    ranks get their ends with the cell (``late_ends``)."""

    def __init__(
        self, plans: tuple[LoaderPlan, ...], namespace: dict[str, Any], world: int, first: int = 0, late: bool = False
    ):
        self.first = first
        self.runtimes = [self._runtime(plan, namespace[plan.name], world, late) for plan in plans]

    @staticmethod
    def _runtime(plan: LoaderPlan, loader: Any, world: int, late: bool) -> _LoaderRuntime:
        prefetch = plan.prefetch or default_prefetch(world, plan.producers, loader.num_workers)
        fd = memfile.new_file("taas-counters", Counters.size(plan.producers, world)) if late else None
        return _LoaderRuntime(
            plan=plan,
            loader=loader,
            stream=StreamPlan(len(loader), world, plan.units),
            channels=[channel_pair() for _ in range(world)],
            counters=Counters(plan.producers, world, -1 if fd is None else fd),
            window=max(1, math.ceil(prefetch / world)),
            seed=plan.seed,
            counters_fd=fd,
        )

    def producers(self) -> list[tuple[Producer, ProducerTask]]:
        tasks = []
        for number, runtime in enumerate(self.runtimes):
            for index in range(runtime.plan.producers):
                task = ProducerTask(
                    name=runtime.plan.name,
                    loader=runtime.loader,
                    plan=runtime.stream,
                    index=index,
                    count=runtime.plan.producers,
                    window=runtime.window,
                    channels=[ends[0] for ends in runtime.channels],
                    counters=runtime.counters,
                    seed=runtime.seed,
                    reports_stats=index == 0,
                    on_demand=runtime.plan.on_demand,
                )
                tasks.append((Producer(self.first + number, index), task))
        return tasks

    def producer_sockets(self, key: Producer) -> set[int]:
        """Descriptors producer ``key`` keeps: its loader's producers' ends, one per rank."""
        return {ends[0].fileno() for ends in self.runtimes[key.loader - self.first].channels}

    def rank_sockets(self, rank: int) -> set[int]:
        """Descriptors rank ``rank`` keeps: its own end of each loader's channel."""
        return {runtime.channels[rank][1].fileno() for runtime in self.runtimes}

    def rank_loaders(self) -> tuple[RankLoader, ...]:
        return tuple(RankLoader(runtime) for runtime in self.runtimes)

    def late_ends(self, rank: int) -> tuple[int, ...]:
        """For a rank that runs already: its end of each loader's channel, then each loader's counters file
        (``late_stand_ins`` takes them in that order)."""
        return tuple(runtime.channels[rank][1].fileno() for runtime in self.runtimes) + tuple(
            runtime.counters_fd for runtime in self.runtimes if runtime.counters_fd is not None
        )

    def close(self, keep_rank_ends: bool = False) -> None:
        """This process's copies of the channels; the producers and ranks keep theirs. ``keep_rank_ends``: but
        the ranks' ends, for a rank started in place of one that died (``SessionLoaders``)."""
        for runtime in self.runtimes:
            for producers_end, ranks_end in runtime.channels:
                producers_end.close()
                if not keep_rank_ends:
                    ranks_end.close()
            if runtime.counters_fd is not None:
                os.close(runtime.counters_fd)
                runtime.counters_fd = None


class SessionLoaders:
    """A session's data delivery, in its supervisor on this machine: the loaders it serves, each rank's end of
    their channels kept open (what producers send a rank that died waits there for the new process in its
    place, which takes over its share), and the names producers find loaders in, for loaders the session
    begins to serve while it runs."""

    def __init__(self, namespace: dict[str, Any], world: int):
        self.namespace = namespace
        self.world = world
        self._services: list[DataService] = []
        self._serving: dict[str, RankLoader] = {}  # by name: a loader served under a name used before replaces it

    def keep(self, service: DataService) -> None:
        """``service``'s producers and ranks are forked (and late ranks sent their ends): keep the ranks' ends."""
        service.close(keep_rank_ends=True)
        self._services.append(service)
        self._serving.update({loader.name: loader for loader in service.rank_loaders()})

    def new_service(self, plans: tuple[LoaderPlan, ...], first: int, go_on: bool = False) -> DataService:
        """The producers' side of loaders the session begins to serve (its names unpacked into ``namespace``).
        ``go_on``: loaders it served, planned anew for a new number of ranks (``world``): each stream goes on at
        the pass after those the ranks that stay have been in, and the producers that served it end."""
        service = DataService(plans, self.namespace, self.world, first=first, late=True)
        for runtime in service.runtimes:
            earlier = self._serving.get(runtime.plan.name)
            if go_on and earlier is not None:
                _go_on(earlier.runtime, runtime)
        return service

    def for_replacement(self, rank: int) -> tuple[set[int], tuple[RankLoader, ...]]:
        """What a new process in place of rank ``rank`` keeps (its ends), and what builds its stand-ins."""
        loaders = tuple(dataclasses.replace(loader, replaces=True) for loader in self._serving.values())
        return {loader.runtime.channels[rank][1].fileno() for loader in loaders}, loaders

    def sockets(self) -> set[int]:
        """The ranks' ends this process keeps."""
        return {
            ranks_end.fileno()
            for service in self._services
            for runtime in service.runtimes
            for _, ranks_end in runtime.channels
        }

    def close(self) -> None:
        for service in self._services:
            service.close()
        self._services.clear()


def _go_on(earlier: _LoaderRuntime, later: _LoaderRuntime) -> None:
    """``later`` serves ``earlier``'s stream from its next pass on, to a new number of ranks: every rank starts
    there (its counters say where, for its stand-in and the producers); ``earlier``'s producers end."""
    staying = range(min(earlier.stream.world, later.stream.world))
    start = max(next_pass(earlier.stream, earlier.counters, rank) for rank in staying)
    upcoming = next((pass_ for pass_ in later.stream.passes() if pass_.number >= start), None)
    counters = later.counters
    for rank in range(later.stream.world):
        counters.passes_over[rank] = start
        counters.position[rank] = upcoming.first_round if upcoming is not None else 0
        counters.done[rank] = int(upcoming is None)  # a stream at its end: nothing more to send
    counters.asked[0] = earlier.counters.any_asked()  # producers of a loader the ranks iterate build at once
    for rank in range(earlier.stream.world):
        earlier.counters.done[rank] = 1


def late_stand_ins(
    plans: tuple[LoaderPlan, ...],
    fds: list[int],
    namespace: dict[str, Any],
    rank: int,
    world: int,
    device: str,
    reports: bool = True,
) -> None:
    """In a session's rank: stand-ins for loaders the session began to serve with this cell, or serves anew as it
    was resized (in place of their stand-ins, at the pass the counters say), over the ends ``late_ends`` sent (the
    descriptors are this rank's to keep or close). ``reports``: False on a cluster's node, where the kernel makes
    the progress line of every node's counters."""
    count = len(plans)
    for plan, channel_fd, counters_fd in zip(plans, fds[:count], fds[count:]):
        loader = namespace[plan.name]
        loader = loader.original if isinstance(loader, StandIn) else loader
        counters = Counters(plan.producers, world, counters_fd)
        os.close(counters_fd)  # the mapping stays
        stand_in = StandIn(
            plan.name,
            loader,
            rank,
            StreamPlan(len(loader), world, plan.units),
            socket.socket(fileno=channel_fd),
            counters,
            plan.fastest,
            device,
            reports=reports,
        )
        if counters.passes_over[rank]:
            stand_in.start_at(int(counters.passes_over[rank]))
        namespace[plan.name] = stand_in
