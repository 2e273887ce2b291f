"""What a run's processes said and how they ended, and which of them failed on their own.

The run state machine (``run_state.py``) writes the ledger as events come and asks it, at the end, for the
run's failures. Which failure a user reads first is decided here: the one that came first among those that
failed on their own. A process whose error only says that a peer went away (gloo's "connection closed by
peer" as that peer exited) is *broken*, not failed, when a failure of its own came before it, or so little
after it that the order is the clocks' (``PEER_SLACK``): whichever reached taas first, the answer is the same.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Mapping

from taas_magic.kernel.run.run_result import Failure
from taas_magic.wire.events import Key, Producer, key_order
from taas_magic.wire.records import CellEnded, Failed, SavedOnNode

# taas sees a death a moment after it happened (its supervisor reaps it, the pump reads the event): a peer
# that failed because of it (its channel broke) may have caught its error before that moment.
SEEN_LATE = 0.25
# A process whose error says a peer went away (``Failed.peer_lost``) is broken by a failure that came before it,
# or this little after: the clocks of a cluster's nodes, and the moment taas saw a death, are this far apart.
PEER_SLACK = 1.0


@dataclass
class Ledger:
    """What the processes reported and how they exited."""

    records: dict[Key, CellEnded | Failed] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)  # each sending rank's names: a Result's data
    saves_skipped: dict[str, set[Key]] = field(default_factory=dict)
    saved_on_nodes: list[SavedOnNode] = field(default_factory=list)
    exits: dict[Key, tuple[int, float]] = field(default_factory=dict)  # exit status, when taas saw it
    own_deaths: set[Key] = field(default_factory=set)  # stopped, but killed by a signal taas had not sent
    tails: dict[Key, tuple[str, ...]] = field(default_factory=dict)  # the last stderr lines of those that exited

    def exited(self, key: Key, code: int, now: float, tail: Iterable[str], by_itself: bool = False) -> None:
        """``key``'s process exited with ``code`` (seen at ``now``), its last stderr lines ``tail``; ``by_itself``:
        taas had stopped it, but a signal it had not sent killed it (a crash, the OOM killer)."""
        self.exits[key] = (code, now)
        self.tails[key] = tuple(tail)
        if by_itself:
            self.own_deaths.add(key)

    def keys(self) -> set[Key]:
        """Every process the ledger has a word of: a report, or an exit."""
        return set(self.records) | set(self.exits)

    def exiting(self) -> bool:
        """A rank's cell called sys.exit(): the rank is ending (in a session, its exit ends the session)."""
        return any(isinstance(record, CellEnded) and record.exited for record in self.records.values())

    def producer_failed(self) -> bool:
        """A producer reported its failure: its exit (which ends a session) follows."""
        return any(isinstance(key, Producer) and isinstance(record, Failed) for key, record in self.records.items())

    def skipped(self) -> dict[int, dict[str, str]]:
        """Each rank's names that it left out of what it sent back, with why."""
        return {
            key: dict(record.skipped)
            for key, record in self.records.items()
            if isinstance(key, int) and isinstance(record, CellEnded) and record.skipped
        }

    def failures(
        self,
        ended: Mapping[Key, tuple[int, float]],
        *,
        left_out: Collection[Key],
        stopped: Collection[Key],
        quit: Collection[Key],
    ) -> list[Failure]:
        """The failures among the processes that ``ended`` (exit status, when), earliest first, those that say a
        peer went away after the others: a reported error, or an exit status of its own. Not failures:
        ``left_out`` (producers retired once the ranks were done), a rank that taas interrupted (``stopped``) or
        whose debugger the user quit (``quit``), and a death by taas's own signal."""
        failures = []
        for key, (code, when) in sorted(ended.items(), key=lambda item: key_order(item[0])):
            record = self.records.get(key)
            if key in left_out:
                continue
            if isinstance(record, Failed):
                if (record.interrupted and key in stopped) or key in quit:
                    continue
                failures.append(
                    Failure(
                        key,
                        record.time or when,
                        tuple(record.traceback),
                        record.where,
                        record.hint,
                        (record.ename, record.evalue),
                        interrupted=record.interrupted,
                        peer_lost=record.peer_lost,
                    )
                )
            elif code != 0 and (key not in stopped or key in self.own_deaths):
                failures.append(Failure(key, when - SEEN_LATE, self.tails.get(key, ()), code=code))
        # A failure that says a peer went away is a consequence: another, even one seen later (a node's loss, told
        # by Ray seconds after its ranks' peers lost their connections), is the cause.
        return sorted(failures, key=lambda failure: (failure.peer_lost, failure.time))

    def how_left(self, key: Key, running: Collection[Key], stopped: Collection[Key]) -> str:
        """How a process that is not at work now left its work, as the stacks' listing says it."""
        record = self.records.get(key)
        if isinstance(record, CellEnded):
            return f"exited early with {record.exited}" if record.exited else "had finished the cell"
        if isinstance(record, Failed) and record.interrupted and key in stopped:
            return "was interrupted by taas"
        if isinstance(record, Failed):
            return f"failed ({record.ename})"
        code = self.exits.get(key, (None, 0.0))[0]
        if code is None:
            return "is still running" if key in running else "had left"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"


def own_and_broken(failures: list[Failure]) -> tuple[list[Failure], list[Failure]]:
    """``failures`` split: those of their own, the root cause first; and those whose error only says that one
    of them went away, which are not failures of their own. With no failure of its own, the broken
    connection is all there is to say: every failure is kept."""
    own = [failure for failure in failures if not failure.peer_lost]
    if not own:
        return failures, []
    first = own[0].time
    broken = [failure for failure in failures if failure.peer_lost and failure.time >= first - PEER_SLACK]
    return [failure for failure in failures if failure not in broken], broken
