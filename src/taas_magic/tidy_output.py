"""Ranks' output as the live view shows it: bars in their rank's row, one line where several ranks say the same.

Eight ranks writing into one cell make a wall of text. Two rules tidy it:

- A line redrawn with carriage returns (tqdm, Lightning's bar, a Keras-style bar) is a bar: while
  it is redrawn it goes to ``bar(rank, text)``, which shows it in the rank's row of the live view,
  and not into the output. Its final state, once its line ends, is written once, labelled.
- A complete line waits up to ``COLLAPSE_WINDOW`` for other ranks to print the same line; lines that
  are the same are written once, labelled with every rank that printed it: ``[ranks 0-7] UserWarning: …``.
  Each rank's lines keep their order.

Every line is labelled, empty ones too, when the output shows several ranks. Nothing is dropped
but the drawings a bar replaced and lines a bar cleared. Held text stays bounded: a bar keeps
only its latest drawing, and a line waits at most the window.
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from .backend import Key
from .streams import PARTIAL_LINE_DELAY, PARTIAL_LINE_MAX, RankOutput, _Source

COLLAPSE_WINDOW = 0.25  # seconds a complete line waits for other ranks to print the same
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class _Line:
    text: str
    arrived: float


class _Collapser:
    """One output stream's complete lines, held per rank until they are written.

    A line is written when every rank has printed it (at once, labelled with all of them), or
    when it has waited ``window`` seconds (labelled with the ranks that printed it by then).
    Either way the lines each of those ranks printed before it are written first: each rank's
    lines keep their order, whatever the other ranks print in between.
    """

    def __init__(self, expected: int, window: float = COLLAPSE_WINDOW):
        self.expected = expected  # ranks that may print the same line
        self.window = window
        self.queues: dict[Key, deque[_Line]] = {}
        self.counts: dict[Key, dict[str, int]] = {}  # rank -> how often each text waits in its queue

    def add(self, rank: Key, text: str, now: float) -> None:
        if rank not in self.queues:
            self.queues[rank], self.counts[rank] = deque(), {}
        self.queues[rank].append(_Line(text, now))
        counts = self.counts[rank]
        counts[text] = counts.get(text, 0) + 1

    def release(self, now: float, rank: Key | None = None, everything: bool = False) -> list[tuple[list[Key], str]]:
        """The lines due, in an order that keeps each rank's: (ranks, text).

        ``rank``: that rank's lines are all due (it writes something that cannot wait);
        ``everything``: every line is.
        """
        due: list[tuple[list[Key], str]] = []
        while True:
            waiting = [queue for queue in self.queues.values() if queue]
            if rank is not None and self.queues.get(rank):
                oldest = self.queues[rank][0]
            elif rank is None and waiting:
                oldest = min((queue[0] for queue in waiting), key=lambda line: line.arrived)
            else:
                return due
            holders = [key for key, counts in self.counts.items() if counts.get(oldest.text)]
            if len(holders) < self.expected and oldest.arrived + self.window > now and rank is None \
                    and not everything:
                return due
            for holder in holders:
                due += self._before(holder, oldest.text)
            due.append((holders, oldest.text))

    def _before(self, rank: Key, text: str) -> list[tuple[list[Key], str]]:
        """Take ``rank``'s lines up to its first ``text`` (which is taken too); return those before it."""
        queue, counts = self.queues[rank], self.counts[rank]
        earlier: list[tuple[list[Key], str]] = []
        while True:
            line = queue.popleft()
            counts[line.text] -= 1
            if not counts[line.text]:
                del counts[line.text]
            if line.text == text:
                return earlier
            earlier.append(([rank], line.text))


class TidyRankOutput(RankOutput):
    """``RankOutput`` with bars sent to ``bar(rank, text)`` and identical lines of ``expected`` ranks collapsed."""

    def __init__(self, write: Callable[[str, str], object], prefix: bool, expected: int,
                 bar: Callable[[Key, str], object], shown: Iterable[Key] | None = None,
                 labels: Mapping[Key, str] | None = None):
        super().__init__(write, prefix, shown, labels)
        self._bar = bar
        self._collapsers = {name: _Collapser(expected) for name in ("stdout", "stderr")}
        self._bar_shown: dict[Key, str] = {}

    def feed(self, rank: Key, stream: str, data: bytes, now: float | None = None) -> None:
        source = self._source(rank, stream)
        text = source.decoder.decode(data)
        if stream == "stderr":
            self._keep_tail(rank, text)
        if not self._is_shown(rank):
            return
        now = time.monotonic() if now is None else now
        source.pending += text
        source.last_data = now
        end = source.pending.rfind("\n") + 1
        if end:
            lines = source.pending[: end - 1].split("\n")
            source.pending = source.pending[end:]
            self._lines(rank, stream, source, lines, now)
        if "\r" in source.pending[:-1]:  # a lone \r at the end may be half of a \r\n
            self._redraw(rank, source)
        elif len(source.pending) > PARTIAL_LINE_MAX:  # a line that does not end: passed on in pieces
            self._partial(rank, stream, source)
        self._release(stream, now)

    def flush_idle(self, now: float | None = None) -> None:
        """Lines whose window is over are written; so are partial lines (not bars) of a quiet rank."""
        now = time.monotonic() if now is None else now
        for (rank, stream), source in self._sources.items():
            if not source.pending or now - source.last_data < PARTIAL_LINE_DELAY:
                continue
            if "\r" in source.pending:
                self._redraw(rank, source)  # it ended with its \r: a bar, drawn before its \r
            else:
                self._partial(rank, stream, source)
        for stream in self._collapsers:
            self._release(stream, now)

    def finish(self, rank: Key | None = None) -> None:
        """Everything held for ``rank`` (every rank by default) is written: an unfinished line as a whole one."""
        self._end_lines(rank)
        for stream in self._collapsers:
            self._release(stream, time.monotonic(), rank, everything=rank is None)

    def exited(self, rank: Key) -> None:
        """The rank is gone: its unfinished line ends, and its lines still wait out their window (the
        other ranks' last lines, often the same, are on their way)."""
        self._end_lines(rank)

    def _end_lines(self, rank: Key | None) -> None:
        now = time.monotonic()
        for (source_rank, stream), source in self._sources.items():
            if rank is not None and source_rank != rank:
                continue
            text = source.pending + source.decoder.decode(b"", final=True)
            source.pending = ""
            if text and self._is_shown(source_rank):
                self._lines(source_rank, stream, source, [text], now)

    def _lines(self, rank: Key, stream: str, source: _Source, lines: list[str], now: float) -> None:
        """Complete lines of ``rank``: bars' final drawings, lines to label and collapse, or (one rank
        shown, a producer, the end of a line already begun) lines written at once, in one piece."""
        collapse = isinstance(rank, int) and self._prefix
        direct: list[str] = []
        for line in lines:
            if line.endswith("\r"):
                line = line[:-1]  # its \r\n
            if "\r" in line:
                final = _last_drawing(line)
                if final is None or not final.strip():  # a bar that erased itself when done (tqdm's leave=False)
                    if not source.at_line_start:  # ... and what was written of its line: end that line
                        direct.append("\n")
                        source.at_line_start = True
                    continue
                self._show_bar(rank, final)
                line = final
            if not source.at_line_start:  # it continues what was written of it already
                direct.append(line + "\n")
                source.at_line_start = True
            elif collapse:
                self._collapsers[stream].add(rank, line, now)
            else:
                direct.append(source.prefix + line + "\n")
        if direct:
            self._write(stream, source, "".join(direct), ends_line=True)

    def _redraw(self, rank: Key, source: _Source) -> None:
        """A bar being redrawn: the row shows its latest drawing; only that drawing is kept."""
        drawing = _last_drawing(source.pending)
        if drawing is None:
            return
        self._show_bar(rank, drawing)
        source.pending = "\r" + drawing + ("\r" if source.pending.endswith("\r") else "")  # the next drawing starts over it

    def _show_bar(self, rank: Key, drawing: str) -> None:
        text = _ANSI.sub("", drawing).strip()
        if text and self._bar_shown.get(rank) != text:
            self._bar_shown[rank] = text
            self._bar(rank, text)

    def _partial(self, rank: Key, stream: str, source: _Source) -> None:
        """An unfinished line (a prompt, a line too long to hold) is written as it is, labelled, after
        the rank's lines still in the window."""
        self._release(stream, time.monotonic(), rank)
        text, source.pending = source.pending, ""
        self._write(stream, source, (source.prefix if source.at_line_start else "") + text, ends_line=False)

    def _write(self, stream: str, source: _Source, text: str, ends_line: bool) -> None:
        target = self._targets[stream]
        if target.open_source not in (None, source):
            text = "\n" + text  # another rank left a line open: end it rather than mix into it
            target.open_source.at_line_start = True
        target.write(text)
        source.at_line_start = ends_line
        target.open_source = None if ends_line else source

    def _release(self, stream: str, now: float, rank: Key | None = None, everything: bool = False) -> None:
        due = self._collapsers[stream].release(now, rank, everything)
        if not due:
            return
        target = self._targets[stream]
        text = "".join(_labelled(ranks, line) for ranks, line in due)
        if target.open_source is not None:
            text = "\n" + text
            target.open_source.at_line_start = True
            target.open_source = None
        target.write(text)


def _last_drawing(text: str) -> str | None:
    """What a line redrawn with carriage returns shows now: its last drawing (None: nothing drawn yet)."""
    drawings = text.split("\r")
    while drawings and not drawings[-1]:
        drawings.pop()
    return drawings[-1] if drawings else None


def _labelled(ranks: list[Key], text: str) -> str:
    """``[rank 3] text`` or ``[ranks 0-3,6] text``; an empty line is its label alone."""
    numbers = sorted(rank for rank in ranks if isinstance(rank, int))
    label = f"[rank {numbers[0]}]" if len(numbers) == 1 else f"[ranks {spans(numbers)}]"
    return f"{label} {text}\n" if text else label + "\n"


def spans(numbers: list[int]) -> str:
    """``0-3,6``: consecutive numbers as ranges."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
