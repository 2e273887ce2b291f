"""`taas.progress(step=..., **metrics)` in a rank: its step and metrics, sent to the cell's status lines.

A training loop may call it every step; the rank sends at most four reports a second (the
latest one), and the last one when the cell ends, so the kernel always shows where each rank
finished. Outside a rank (in the kernel) it does nothing.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from taas_magic.wire.records import RankProgress

INTERVAL = 0.25  # seconds between two reports of one rank

_send: Callable[[RankProgress], None] | None = None
_last_sent = 0.0
_unsent: RankProgress | None = None


def attach(send: Callable[[RankProgress], None]) -> None:
    """In a rank, as it starts: where its reports go."""
    global _send, _last_sent, _unsent
    _send, _last_sent, _unsent = send, 0.0, None


def note(step: int | None, metrics: dict[str, Any]) -> None:
    global _last_sent, _unsent
    if _send is None:
        return
    now = time.monotonic()
    record = RankProgress(
        now, None if step is None else int(step), {name: float(value) for name, value in metrics.items()}
    )
    if now - _last_sent >= INTERVAL:
        _send(record)
        _last_sent, _unsent = now, None
    else:
        _unsent = record


def flush() -> None:
    """The cell ended: the latest report goes, if it has not."""
    global _unsent
    if _send is not None and _unsent is not None:
        _send(_unsent)
        _unsent = None
