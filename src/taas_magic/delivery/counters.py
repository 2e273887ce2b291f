"""Counters shared by a loader's producers and the ranks: progress, flow control, waiting time.

One anonymous shared mapping per loader, made before anything is forked, so every process of
the run sees the same memory. Each counter has a single writer (a producer or a rank), so
plain aligned 64-bit stores suffice: readers only need a recent value, never a lock.
"""

from __future__ import annotations

import mmap
from typing import Any


class Counters:
    def __init__(self, producers: int, ranks: int):
        import torch

        self.producers, self.ranks = producers, ranks
        self._memory = mmap.mmap(-1, 8 * (producers + 4 * ranks))  # MAP_SHARED | MAP_ANONYMOUS
        values = torch.frombuffer(self._memory, dtype=torch.int64)
        values.zero_()
        self.produced = values[:producers]  # elements built, per producer
        self.consumed = values[producers : producers + ranks]  # elements taken, per rank
        self.wait_ns = values[producers + ranks : producers + 2 * ranks]  # time spent waiting, per rank
        self.first_ns = values[producers + 2 * ranks : producers + 3 * ranks]  # wait for the first element
        self.done = values[producers + 3 * ranks :]  # 1 once a rank's cell has ended: wait for it no more

    def slowest_rank(self) -> int | float:
        """Rounds taken by the slowest rank still running (infinite when none is)."""
        running = self.consumed[self.done == 0]
        return int(running.min()) if running.numel() else float("inf")

    def is_done(self, rank: int) -> bool:
        return bool(self.done[rank])

    def stats(self, name: str) -> dict[str, Any]:
        return {"stats": name, "produced": int(self.produced.sum()), "consumed": self.consumed.tolist(),
                "wait_ns": self.wait_ns.tolist()}
