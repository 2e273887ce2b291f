"""In the kernel: where each rank's time went, and the rank the others waited for, from the activity samples
the ranks send anyway (``RankActivity``, about once a second, for the hang doctor).

Each sample says what its rank was doing at that instant: in process-group setup, in a collective, waiting
for a registered loader's data, or none of these: computing (the cell's own work, its sleeps included).
The ranks take their samples at jittered instants (``rank/vitals.py``), so the share of a rank's samples in
each state estimates the share of its time, whatever the period of its loop; ten samples give a tenth.

A rank the others wait for spends its time computing while they sit in the collective it has not reached:
among ranks whose shares in collectives split into a low group and a high one, far apart, the low group is
named, when it is the smaller.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from taas_magic.per_rank import span
from taas_magic.wire.records import RankActivity

SETUP, DATA, COMPUTING = "setup", "data", "computing"
COLLECTIVES = "collectives"  # a rank's collectives of several kinds, or of a kind its samples did not name
MIN_SAMPLES = 4  # fewer say too little of a rank's time to be shown
WAITED_GAP = 0.25  # the least gap between the shares in collectives of the ranks waited for and the others'
WAITED_SHARE = 0.25  # the least share of their time the others spent in collectives, for a rank to be named


@dataclass
class Shares:
    """One rank's samples, counted by what it was doing."""

    counts: Counter[str] = field(default_factory=Counter)  # SETUP, DATA, COMPUTING, COLLECTIVES
    ops: Counter[str] = field(default_factory=Counter)  # the collectives its samples named: "all_reduce"

    def add(self, sample: RankActivity) -> None:
        if sample.setup is not None:
            self.counts[SETUP] += 1
        elif sample.collectives:
            self.counts[COLLECTIVES] += 1
            if sample.collectives[0].op:
                self.ops[sample.collectives[0].op] += 1
        elif sample.waiting:
            self.counts[DATA] += 1
        else:
            self.counts[COMPUTING] += 1

    @property
    def samples(self) -> int:
        return sum(self.counts.values())

    def share(self, state: str) -> float:
        return self.counts[state] / self.samples if self.samples else 0.0

    def collectives_name(self) -> str:
        """The kind of collective it spent its time in, when its samples named one kind only."""
        return next(iter(self.ops)) if len(self.ops) == 1 else COLLECTIVES

    def text(self) -> str:
        """ "computing 61% · all_reduce 35% · data 4%": largest first, states it was never seen in left out."""
        names = {COLLECTIVES: self.collectives_name()}
        parts = sorted(((self.share(state), names.get(state, state)) for state in self.counts), reverse=True)
        return " · ".join(f"{name} {share:.0%}" for share, name in parts if share > 0)


@dataclass(frozen=True)
class Waited:
    """The ranks the others waited for, and how much of their time the others spent waiting."""

    ranks: tuple[int, ...]
    share: float  # the others' mean share of their time in collectives
    op: str  # the collective they waited in ("collectives" when several kinds, or none named)

    def text(self) -> str:
        return f"the others waited for {span(list(self.ranks))}: {self.share:.0%} of their time in {self.op}"


def lines(shares: Mapping[int, Shares]) -> list[str]:
    """Each rank's shares, ranks that read alike on one line (``ranks 0-2,4: all_reduce 83% · computing 17%``),
    then the ranks the others waited for, if any."""
    alike: dict[str, list[int]] = {}
    for rank in sorted(shares):
        alike.setdefault(shares[rank].text(), []).append(rank)
    said = [f"{span(ranks)}: {text}" for text, ranks in alike.items()]
    waited = waited_for(shares)
    return said + ([waited.text()] if waited is not None else [])


def counted(shares: Mapping[int, Shares]) -> dict[int, Shares]:
    """The ranks with samples enough to be shown; none unless every rank has them."""
    if len(shares) < 2 or any(s.samples < MIN_SAMPLES for s in shares.values()):
        return {}
    return dict(shares)


def waited_for(shares: Mapping[int, Shares]) -> Waited | None:
    """The ranks the others waited for, if the ranks' shares in collectives split far apart with the
    smaller group below; None for a balanced run (or one with too few samples)."""
    ranks = counted(shares)
    if not ranks:
        return None
    order = sorted(ranks, key=lambda rank: ranks[rank].share(COLLECTIVES))
    values = [ranks[rank].share(COLLECTIVES) for rank in order]
    gap, cut = max((values[i + 1] - values[i], i + 1) for i in range(len(values) - 1))
    low, high = order[:cut], order[cut:]
    share = sum(values[cut:]) / len(high)
    if gap < WAITED_GAP or share < WAITED_SHARE or len(low) > len(high):
        return None
    ops = {ranks[rank].collectives_name() for rank in high}
    return Waited(tuple(sorted(low)), share, ops.pop() if len(ops) == 1 else COLLECTIVES)
