"""Counters shared by a loader's producers and the ranks: flow control and the progress line.

One anonymous shared mapping per loader, made before anything is forked, so every process of
the run sees the same memory. Each counter has a single writer (a producer or a rank), so
plain aligned 64-bit stores suffice: readers only need a recent value, never a lock.

Every element sent to a rank is, at any moment, either taken by the rank's cell, dropped by
the rank (it belongs to a pass the rank left, or the rank's cell has ended), or still
buffered (in the rank's socket or waiting for its turn): so ``buffered`` is exact, and a
rank that stops early shows as skipped elements, not as consumed ones.
"""

from __future__ import annotations

import mmap
import time
from typing import Any


class Counters:
    def __init__(self, producers: int, ranks: int):
        import torch

        self.producers, self.ranks = producers, ranks
        self._memory = mmap.mmap(-1, 8 * (producers * (1 + ranks) + 5 * ranks))  # MAP_SHARED | MAP_ANONYMOUS
        values = torch.frombuffer(self._memory, dtype=torch.int64)
        values.zero_()
        cuts = iter(values.split([producers, producers * ranks] + [ranks] * 5))
        self.produced = next(cuts)  # elements built, per producer
        self.sent = next(cuts).view(producers, ranks)  # elements sent, per producer and rank
        self.position = next(cuts)  # rounds of the stream each rank is past, skipped ones included
        self.taken = next(cuts)  # elements each rank's cell took
        self.dropped = next(cuts)  # elements a rank received, or held, and threw away
        self.passes_over = next(cuts)  # passes each rank has left or finished: none of them is sent any more
        self.done = next(cuts)  # 1 once a rank's cell has ended: send it nothing, wait for it no more

    def slowest_rank(self) -> int | float:
        """Rounds taken by the slowest rank still running (infinite when none is)."""
        running = self.position[self.done == 0]
        return int(running.min()) if running.numel() else float("inf")

    def is_done(self, rank: int) -> bool:
        return bool(self.done[rank])

    def all_done(self) -> bool:
        return bool(self.done.all())

    def wants(self, rank: int, pass_number: int) -> bool:
        """Whether ``rank`` still reads elements of pass ``pass_number``."""
        return not self.done[rank] and pass_number >= int(self.passes_over[rank])

    def stats(self, name: str) -> dict[str, Any]:
        """The progress of one loader now: what the producers built and what became of it in each rank."""
        running = self.done == 0
        buffered = ((self.sent.sum(0) - self.taken - self.dropped).clamp(min=0) * running).sum()
        return {"stats": name, "at": time.monotonic(), "produced": int(self.produced.sum()),
                "taken": self.taken.tolist(), "skipped": (self.position - self.taken).tolist(),
                "buffered": int(buffered), "done": self.done.tolist()}
