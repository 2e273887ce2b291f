"""The producers' side of a run, in the process that forks the ranks (the kernel or the fork server).

For each registered loader the cell uses: one channel per rank, shared counters, and the
tasks of its K producers. Built before anything is forked, so producers and ranks inherit
their ends; this process closes its copies once they have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..backend import Key, Producer
from .counters import Counters
from .plan import StreamPlan
from .producer import ProducerTask
from .standin import StandIn
from .transport import channel_pair


@dataclass(frozen=True)
class LoaderPlan:
    """What the cell asks of one registered loader (picklable: it travels to the fork server)."""

    name: str
    producers: int
    units: int | None
    prefetch: int | None
    fastest: bool
    seed: int  # the run's seed for per-sample seeding, taken in the kernel


def producer_labels(plans: tuple[LoaderPlan, ...]) -> dict[Key, str]:
    return {Producer(n, j): f"producer {j} of {plan.name}" for n, plan in enumerate(plans)
            for j in range(plan.producers)}


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


@dataclass(frozen=True)
class RankLoader:
    """A rank's view of one loader's delivery: builds its stand-in inside the rank."""

    runtime: _LoaderRuntime

    @property
    def name(self) -> str:
        return self.runtime.plan.name

    def stand_in(self, rank: int, loader: Any, device: str) -> StandIn:
        runtime = self.runtime
        return StandIn(self.name, loader, rank, runtime.stream, runtime.channels[rank][1], runtime.counters,
                       runtime.plan.fastest, device)


class DataService:
    def __init__(self, plans: tuple[LoaderPlan, ...], namespace: dict[str, Any], world: int):
        self.runtimes = [self._runtime(plan, namespace[plan.name], world) for plan in plans]

    @staticmethod
    def _runtime(plan: LoaderPlan, loader: Any, world: int) -> _LoaderRuntime:
        prefetch = plan.prefetch or default_prefetch(world, plan.producers, loader.num_workers)
        return _LoaderRuntime(
            plan=plan, loader=loader, stream=StreamPlan(len(loader), world, plan.units),
            channels=[channel_pair() for _ in range(world)], counters=Counters(plan.producers, world),
            window=max(1, math.ceil(prefetch / world)), seed=plan.seed,
        )

    def producers(self) -> list[tuple[Producer, ProducerTask]]:
        tasks = []
        for number, runtime in enumerate(self.runtimes):
            for index in range(runtime.plan.producers):
                task = ProducerTask(
                    name=runtime.plan.name, loader=runtime.loader, plan=runtime.stream, index=index,
                    count=runtime.plan.producers, window=runtime.window,
                    channels=[ends[0] for ends in runtime.channels], counters=runtime.counters,
                    seed=runtime.seed, reports_stats=index == 0,
                )
                tasks.append((Producer(number, index), task))
        return tasks

    def producer_sockets(self, key: Producer) -> set[int]:
        """Descriptors producer ``key`` keeps: its loader's producers' ends, one per rank."""
        return {ends[0].fileno() for ends in self.runtimes[key.loader].channels}

    def rank_sockets(self, rank: int) -> set[int]:
        """Descriptors rank ``rank`` keeps: its own end of each loader's channel."""
        return {runtime.channels[rank][1].fileno() for runtime in self.runtimes}

    def rank_loaders(self) -> tuple[RankLoader, ...]:
        return tuple(RankLoader(runtime) for runtime in self.runtimes)

    def close(self) -> None:
        """This process's copies of the channels; the producers and ranks keep theirs."""
        for runtime in self.runtimes:
            for producers_end, ranks_end in runtime.channels:
                producers_end.close()
                ranks_end.close()
