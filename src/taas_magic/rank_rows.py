"""In the kernel: one status line per rank that reports its progress (``taas.progress``).

    rank 0: step 120, 35.2 steps/s, loss 0.1234 (running)

Each line shows the rank's latest step and metrics, the rate since its previous report, and
how its cell stands: running, done or failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from .records import CellEnded, Failed, RankProgress, Record


@dataclass
class _Row:
    latest: RankProgress
    rate: float | None = None  # steps per second, between the last two reports
    state: str = "running"


class RankRows:
    def __init__(self) -> None:
        self.rows: dict[int, _Row] = {}

    def take(self, rank: int, record: Record) -> bool:
        """Note a rank's report; True if its line changed."""
        row = self.rows.get(rank)
        if isinstance(record, RankProgress):
            if row is None:
                self.rows[rank] = _Row(record)
            elif record.at > row.latest.at:
                row.rate = _rate(row.latest, record)
                row.latest = record
            return True
        if row is not None and isinstance(record, (CellEnded, Failed)):
            row.state = "failed" if isinstance(record, Failed) and not record.interrupted else (
                "stopped" if isinstance(record, Failed) else "done")
            return True
        return False

    def lines(self) -> list[str]:
        return [_line(rank, row) for rank, row in sorted(self.rows.items())]


def _rate(before: RankProgress, after: RankProgress) -> float | None:
    if before.step is None or after.step is None or after.at <= before.at:
        return None
    return (after.step - before.step) / (after.at - before.at)


def _line(rank: int, row: _Row) -> str:
    parts = [] if row.latest.step is None else [f"step {row.latest.step}"]
    if row.rate is not None and row.state == "running":
        parts.append(f"{row.rate:,.1f} steps/s")
    parts += [f"{name} {value:.4g}" for name, value in row.latest.metrics.items()]
    return f"rank {rank}: {', '.join(parts)} ({row.state})"
