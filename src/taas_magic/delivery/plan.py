"""The stream of a registered loader, and who gets what: pure arithmetic, tested on its own.

The stream is the loader's passes one after another, each reshuffled as the DataLoader would
for a new epoch, cut after ``units`` elements in total. Element i of a pass goes to rank
``i mod W``. Like ``DistributedSampler(drop_last=False)``, a pass whose length is not a multiple
of W is padded by wrapping around to its first elements, so every rank receives the same
number of elements per pass and DDP stays in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Pass:
    """One pass over the loader, as far as the budget of units allows."""

    number: int
    real: int  # elements taken from the loader in this pass
    first_round: int  # rounds (one element per rank) before this pass, counted over the whole stream
    first_element: int = 0  # elements of the stream before this pass: element i of it is element first_element + i

    def padded(self, world: int) -> int:
        return -(-self.real // world) * world

    def rounds(self, world: int) -> int:
        return self.padded(world) // world


@dataclass(frozen=True)
class StreamPlan:
    pass_length: int  # len(loader): elements in a full pass
    world: int
    units: int | None  # elements to take in total; None: as many as the ranks ask for

    def __post_init__(self) -> None:
        if self.pass_length < 1 or self.world < 1 or (self.units is not None and self.units < 1):
            raise ValueError(f"bad stream plan {self}")

    def share(self) -> int:
        """Elements each rank receives in a full pass: ``len()`` of the stand-in."""
        return -(-self.pass_length // self.world)

    def passes(self) -> Iterator[Pass]:
        """The passes of the stream, in order; endless when ``units`` is None."""
        number, taken, rounds = 0, 0, 0
        while self.units is None or taken < self.units:
            real = self.pass_length if self.units is None else min(self.pass_length, self.units - taken)
            current = Pass(number, real, rounds, taken)
            yield current
            number, taken, rounds = number + 1, taken + real, rounds + current.rounds(self.world)

    def first_pass_from(self, round_: int) -> Pass | None:
        """The first pass that starts at round ``round_`` of the stream or after it; None: the stream ends before."""
        return next((pass_ for pass_ in self.passes() if pass_.first_round >= round_), None)

    def destinations(self, pass_: Pass, index: int) -> list[tuple[int, int]]:
        """(rank, round in the stream) for every place element ``index`` of ``pass_`` is delivered."""
        places = [(index % self.world, pass_.first_round + index // self.world)]
        for position in range(pass_.real, pass_.padded(self.world)):
            if (position - pass_.real) % pass_.real == index:  # padding wraps to the pass's start
                places.append((position % self.world, pass_.first_round + position // self.world))
        return places

    def sequence(self, pass_: Pass, rank: int) -> list[int]:
        """The element indices ``rank`` receives in ``pass_``, in order."""
        positions = range(rank, pass_.padded(self.world), self.world)
        return [p if p < pass_.real else (p - pass_.real) % pass_.real for p in positions]
