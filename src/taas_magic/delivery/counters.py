"""Counters shared by a loader's producers and the ranks: flow control and the progress line.

One anonymous shared mapping per loader, made before anything is forked, so every process of
the run sees the same memory. Each counter has a single writer (a producer or a rank), so
plain aligned 64-bit stores suffice: readers only need a recent value, never a lock. They are
plain integers in a memoryview, not tensors, so that the thread that reports progress in a
producer never holds a lock of torch's while the producer forks its DataLoader workers.

Every element sent to a rank is, at any moment, either taken by the rank's cell, dropped by
the rank (it belongs to a pass the rank left, or the rank's cell has ended), or still
buffered (in the rank's socket or waiting for its turn): so ``buffered`` is exact, and a
rank that stops early shows as skipped elements, not as consumed ones.
"""

from __future__ import annotations

import mmap
import time
from typing import Collection

from taas_magic.wire.records import DeliveryProgress

_RANK_FIELDS = 7  # position, taken, dropped, passes_over, done, waited, asked


class Counters:
    def __init__(self, producers: int, ranks: int, fd: int = -1):
        """Fresh shared counters, or (``fd``, a memory file of ``size(producers, ranks)`` bytes) the
        ones another process made: a cluster node's agent makes them, its fork server's ranks write them."""
        self.producers, self.ranks = producers, ranks
        self._memory = mmap.mmap(fd, self.size(producers, ranks))  # MAP_SHARED (anonymous when fd is -1)
        values = memoryview(self._memory).cast("q")  # zeroed by the system
        self._values = values
        cuts = [producers, producers, producers * ranks] + [ranks] * _RANK_FIELDS
        fields, start = [], 0
        for size in cuts:
            fields.append(values[start : start + size])
            start += size
        self.produced = fields[0]  # elements built, per producer
        self.past = fields[1]  # elements of the stream each producer is past: sent, or passed over for good
        self._sent = fields[2]  # elements sent, per producer and rank (producer-major)
        self.position = fields[3]  # rounds of the stream each rank is past, skipped ones included
        self.taken = fields[4]  # elements each rank's cell took
        self.dropped = fields[5]  # elements a rank received, or held, and threw away
        self.passes_over = fields[6]  # passes each rank has left or finished: none of them is sent any more
        self.done = fields[7]  # 1 once a rank's cell has ended: send it nothing, wait for it no more
        self.waited = fields[8]  # microseconds each rank's cell spent waiting for elements
        self.asked = fields[9]  # 1 once a rank began a pass: a session's producers start building then

    @staticmethod
    def size(producers: int, ranks: int) -> int:
        return 8 * (producers * (2 + ranks) + _RANK_FIELDS * ranks)

    # -- between machines: each row has one writer, so copies merge by who owns which rows -------
    def snapshot(self) -> list[int]:
        return self._values.tolist()

    def take_rows(self, snapshot: list[int], producers: Collection[int] = (), ranks: Collection[int] = ()) -> None:
        """Copy from ``snapshot`` (another machine's copy) the rows of ``producers`` and ``ranks``: those
        that machine writes, and this one only reads."""
        values = self._values
        for producer in producers:
            values[producer] = snapshot[producer]
            values[self.producers + producer] = snapshot[self.producers + producer]
            start = 2 * self.producers + producer * self.ranks
            for index in range(start, start + self.ranks):
                values[index] = snapshot[index]
        rank_fields = self.producers * (2 + self.ranks)
        for field in range(_RANK_FIELDS):
            for rank in ranks:
                index = rank_fields + field * self.ranks + rank
                values[index] = snapshot[index]

    def count_sent(self, producer: int, rank: int) -> None:
        self._sent[producer * self.ranks + rank] += 1

    def sent_to(self, rank: int) -> int:
        """Elements the producers sent ``rank``, all of them together."""
        return sum(self._sent[producer * self.ranks + rank] for producer in range(self.producers))

    def slowest_rank(self) -> int | float:
        """Rounds taken by the slowest rank still running (infinite when none is)."""
        return min((self.position[r] for r in range(self.ranks) if not self.done[r]), default=float("inf"))

    def any_asked(self) -> bool:
        return any(self.asked)

    def is_done(self, rank: int) -> bool:
        return bool(self.done[rank])

    def all_done(self) -> bool:
        return all(self.done)

    def wants(self, rank: int, pass_number: int) -> bool:
        """Whether ``rank`` still reads elements of pass ``pass_number``."""
        return not self.done[rank] and pass_number >= self.passes_over[rank]

    def stats(self, name: str) -> DeliveryProgress:
        """The progress of one loader now: what the producers built and what became of it in each rank."""
        ranks = range(self.ranks)
        sent = [self.sent_to(r) for r in ranks]
        buffered = sum(max(0, sent[r] - self.taken[r] - self.dropped[r]) for r in ranks if not self.done[r])
        return DeliveryProgress(
            name,
            time.monotonic(),
            int(sum(self.produced)),
            self.taken.tolist(),
            [int(self.position[r] - self.taken[r]) for r in ranks],
            int(buffered),
            self.done.tolist(),
            [microseconds / 1e6 for microseconds in self.waited.tolist()],
        )
