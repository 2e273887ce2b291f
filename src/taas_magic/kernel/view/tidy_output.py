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
from collections import Counter, deque
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping

from taas_magic.kernel.view.streams import PARTIAL_LINE_DELAY, PARTIAL_LINE_MAX, RankOutput, StreamSource
from taas_magic.process.containment import to_the_end
from taas_magic.wire.events import Key

COLLAPSE_WINDOW = 0.25  # seconds a complete line waits for other ranks to print the same
# The date and time torch's C++ logging puts at the start of its lines ("[W1206 09:22:22.586743355 socket.cpp:955]
# [c10d] …"): left out where several ranks' lines are shown, so that a warning every rank logs is one line, as
# any other line every rank prints ("[W socket.cpp:955] [c10d] …"); the line comes when it comes anyway.
_LOG_TIME = re.compile(r"^(?P<prefix>(?:\[rank\d+\]:)?\[[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+(?= )", re.MULTILINE)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A bar drawn below another (tqdm's position=1, Lightning's validation bar): down a line, the
# drawing, back up. The line break moves the cursor, it does not end a line.
_LOWER_BAR = re.compile(r"\n+([^\n]*?)(?:\x1b\[\d*A)+")


class _Chunk:
    """Complete lines of one rank that arrived together."""

    __slots__ = ("lines", "texts", "arrived")

    def __init__(self, lines: list[str], arrived: float):
        self.lines = lines
        self.texts = set(lines)
        self.arrived = arrived


Block = tuple[list[Key], list[str]]  # lines to write, and the ranks that printed each of them


class _Collapser:
    """One output stream's complete lines, held per rank until they are written.

    A line is written when it has waited ``window`` seconds, labelled with every rank that printed
    it by then, or at once when every rank has printed it. Either way the lines each of those ranks
    printed before it are written first: each rank's lines keep their order, whatever the other
    ranks print in between.

    Ranks print whole chunks of distinct lines (a loss per step) far more often than the same
    line: the lines of a chunk are held, and compared with other ranks', as one set, so that the
    work per line is done by set and join operations, not a loop of Python per line.
    """

    def __init__(self, expected: int, window: float = COLLAPSE_WINDOW):
        self.expected = expected  # ranks that may print the same line
        self.window = window
        self.queues: dict[Key, deque[_Chunk]] = {}
        # What each rank holds now is what it added less what was taken, counted by text (counting
        # is done in C by Counter.update; subtracting would be a loop of Python per line).
        self.added: dict[Key, Counter[str]] = {}
        self.taken: dict[Key, Counter[str]] = {}

    def add(self, rank: Key, lines: list[str], now: float) -> list[Block]:
        """Hold ``rank``'s lines; return what is due at once: the lines every rank has now printed."""
        with self._counted_again_if_interrupted():
            return self._add(rank, lines, now)

    def _add(self, rank: Key, lines: list[str], now: float) -> list[Block]:
        if rank not in self.queues:
            self.queues[rank], self.added[rank], self.taken[rank] = deque(), Counter(), Counter()
        chunk = _Chunk(lines, now)
        self.queues[rank].append(chunk)
        self._count(rank, lines)
        everyone = chunk.texts
        others = [other for other in self.queues if other != rank]
        if len(others) + 1 < self.expected:
            return []
        for other in others:
            everyone = self._holding(other, everyone)
            if not everyone:
                return []
        due: list[Block] = []
        for text in [line for line in lines if line in everyone]:
            if text in self._holding(rank, {text}):
                due += self._group(rank, text)
        return due

    def release(self, now: float, rank: Key | None = None, everything: bool = False) -> list[Block]:
        """The lines due, in an order that keeps each rank's.

        ``rank``: that rank's lines are all due (it writes something that cannot wait);
        ``everything``: every line is.
        """
        with self._counted_again_if_interrupted():
            return self._release(now, rank, everything)

    def _release(self, now: float, rank: Key | None, everything: bool) -> list[Block]:
        due: list[Block] = []
        while True:
            head = self._due_head(now, rank, everything)
            if head is None:
                return due
            chunk = self.queues[head][0]
            shared: set[str] = set()
            for other in self.queues:
                if other != head:
                    shared |= self._holding(other, chunk.texts)
            if not shared:
                self._take(head, len(chunk.lines))
                due.append(([head], chunk.lines))
            else:
                first = next(line for line in chunk.lines if line in shared)
                due += self._group(head, first)

    def _due_head(self, now: float, rank: Key | None, everything: bool) -> Key | None:
        """The rank whose first held chunk is to be written next, if one is due."""
        if rank is not None:
            return rank if self.queues.get(rank) else None
        heads = [(queue[0].arrived, key) for key, queue in self.queues.items() if queue]
        if not heads:
            return None
        arrived, key = min(heads, key=lambda head: head[0])
        return key if everything or arrived + self.window <= now else None

    def _group(self, rank: Key, text: str) -> list[Block]:
        """``text`` written once for every rank that holds it, after what each of them printed before it."""
        holders = [other for other in self.queues if other == rank or self._holding(other, {text})]
        due: list[Block] = []
        for holder in holders:
            due += self._take_until(holder, text)
        due.append((holders, [text]))
        return due

    def _take_until(self, rank: Key, text: str) -> list[Block]:
        """Take ``rank``'s lines up to its first ``text`` (taken too); return those before it."""
        queue, before = self.queues[rank], []
        while text not in queue[0].texts:
            chunk = queue[0]
            self._take(rank, len(chunk.lines))
            before.append(([rank], chunk.lines))
        index = queue[0].lines.index(text)
        if index:
            before.append(([rank], queue[0].lines[:index]))
        self._take(rank, index + 1)
        return before

    def _take(self, rank: Key, count: int) -> None:
        """The first ``count`` lines of the rank's first chunk are written."""
        queue = self.queues[rank]
        chunk = queue.popleft()
        if count < len(chunk.lines):
            self.taken[rank].update(chunk.lines[:count])
            queue.appendleft(_Chunk(chunk.lines[count:], chunk.arrived))
        elif queue:
            self.taken[rank].update(chunk.lines)
        else:  # it holds nothing now: its counts start again, so they never outgrow what one window holds
            self.added[rank].clear()
            self.taken[rank].clear()

    def _holding(self, rank: Key, texts: set[str]) -> set[str]:
        """Those of ``texts`` that ``rank`` holds now."""
        candidates = texts & self.added[rank].keys()
        if not candidates:
            return candidates
        added, taken = self.added[rank], self.taken[rank]
        return {text for text in candidates if added[text] > taken[text]}

    @contextmanager
    def _counted_again_if_interrupted(self) -> Iterator[None]:
        """An interrupt (the controller catches it and goes on writing) may cut an update of a queue
        and its counts in two: the counts are then made again from the queues, which are the truth."""
        try:
            yield
        except KeyboardInterrupt:
            to_the_end(self._recount)
            raise

    def _recount(self) -> None:
        for rank, queue in self.queues.items():
            self.added[rank] = Counter(line for chunk in queue for line in chunk.lines)
            self.taken[rank] = Counter()

    def _count(self, rank: Key, lines: list[str]) -> None:
        added = self.added[rank]
        if len(added) > 50_000:  # counts of lines long written: start again from what is held
            added.clear()
            self.taken[rank].clear()
            for chunk in self.queues[rank]:
                if chunk.lines is not lines:
                    added.update(chunk.lines)
        added.update(lines)


class TidyRankOutput(RankOutput):
    """``RankOutput`` with bars sent to ``bar(rank, text)`` and identical lines of ``expected`` ranks collapsed."""

    def __init__(
        self,
        write: Callable[[str, str], object],
        prefix: bool,
        expected: int,
        bar: Callable[[Key, str], object],
        shown: Iterable[Key] | None = None,
        labels: Mapping[Key, str] | None = None,
    ):
        super().__init__(write, prefix, shown, labels)
        self._bar = bar
        self._collapsers = {name: _Collapser(expected) for name in ("stdout", "stderr")}
        self._bar_shown: dict[Key, str] = {}

    def feed(self, rank: Key, stream: str, data: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        source = self._take(rank, stream, data, now)
        if source is None:
            return
        if "\x1b[" in source.pending:
            self._lower_bars(rank, source)
        end = source.pending.rfind("\n") + 1
        previous = source.pending.rfind("\n", 0, max(end - 1, 0)) + 1
        if end and "\r" in source.pending[previous : end - 1].removesuffix("\r"):
            end = previous  # the line break after a bar may take the cursor to a lower bar: held
        if end:
            block, source.pending = source.pending[: end - 1], source.pending[end:]
            self._lines(rank, stream, source, block, now)
        unfinished = source.pending[source.pending.rfind("\n") + 1 :]
        if "\r" in unfinished[:-1]:  # a lone \r at the end may be half of a \r\n
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
            end = source.pending.rfind("\n") + 1  # a line break held back after a bar
            if end:
                block, source.pending = source.pending[: end - 1], source.pending[end:]
                self._lines(rank, stream, source, block, now)
                if not source.pending:
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
            if text and self._is_shown(source_rank):  # its last line, ended or not (a held line break)
                self._lines(source_rank, stream, source, text[:-1] if text.endswith("\n") else text, now)

    def _lines(self, rank: Key, stream: str, source: StreamSource, block: str, now: float) -> None:
        """Complete lines of ``rank`` (``block``, without its last line break): bars' final drawings,
        lines to label and collapse, or (one rank shown, a producer) lines written at once."""
        if isinstance(rank, int) and self._prefix:  # lines that may be collapsed: a time stamp would keep them apart
            block = _LOG_TIME.sub(r"\g<prefix>", block)
        lines = block.split("\n") if "\r" not in block else self._without_bars(rank, source, block)
        direct = []
        if lines and not source.at_line_start:  # it continues what was written of it already
            direct.append(lines.pop(0) + "\n")
            source.at_line_start = True
        if lines and isinstance(rank, int) and self._prefix:
            self._write_blocks(stream, self._collapsers[stream].add(rank, lines, now))
        elif lines:
            direct += [source.prefix + line + "\n" for line in lines]
        if direct:
            self._write(stream, source, "".join(direct), ends_line=True)

    def _without_bars(self, rank: Key, source: StreamSource, block: str) -> list[str]:
        """The lines of a block with carriage returns: a bar's last drawing stands for its line, and
        the row shows it; a bar that erased itself when done (tqdm's ``leave=False``) leaves no line."""
        lines: list[str] = []
        for line in block.split("\n"):
            if line.endswith("\r"):
                line = line[:-1]  # its \r\n
            if "\r" in line:
                final = _last_drawing(line)
                if final is None or not final.strip():
                    if not source.at_line_start and not lines:  # it erased what was written of its line too
                        lines.append("")
                    continue
                self._show_bar(rank, final)
                line = final
            lines.append(line)
        return lines

    def _lower_bars(self, rank: Key, source: StreamSource) -> None:
        """Bars drawn below the current line go to the rank's row; the cursor's trips to them leave no lines."""

        def drawn(match: re.Match[str]) -> str:
            drawing = _last_drawing(match[1])
            if drawing is not None:
                self._show_bar(rank, drawing)
            return ""

        source.pending = _LOWER_BAR.sub(drawn, source.pending)

    def _redraw(self, rank: Key, source: StreamSource) -> None:
        """A bar being redrawn: the row shows its latest drawing; only that drawing is kept."""
        held, line_break, unfinished = source.pending.rpartition("\n")  # a bar's held line, if any
        drawing = _last_drawing(unfinished)
        if drawing is None:
            return
        self._show_bar(rank, drawing)
        source.pending = (
            held + line_break + "\r" + drawing + ("\r" if unfinished.endswith("\r") else "")
        )  # the next drawing starts over it

    def _show_bar(self, rank: Key, drawing: str) -> None:
        text = _ANSI.sub("", drawing).strip()
        if text and self._bar_shown.get(rank) != text:
            self._bar_shown[rank] = text
            self._bar(rank, text)

    def _partial(self, rank: Key, stream: str, source: StreamSource) -> None:
        """An unfinished line (a prompt, a line too long to hold) is written as it is, labelled, after
        the rank's lines still in the window."""
        self._release(stream, time.monotonic(), rank)
        text, source.pending = source.pending, ""
        self._write(stream, source, (source.prefix if source.at_line_start else "") + text, ends_line=False)

    def _write(self, stream: str, source: StreamSource, text: str, ends_line: bool) -> None:
        self._targets[stream].put(text, source, ends_line)
        source.at_line_start = ends_line

    def _release(self, stream: str, now: float, rank: Key | None = None, everything: bool = False) -> None:
        self._write_blocks(stream, self._collapsers[stream].release(now, rank, everything))

    def _write_blocks(self, stream: str, due: list[Block]) -> None:
        if not due:
            return
        self._targets[stream].put("".join(_labelled(ranks, lines) for ranks, lines in due), None, ends_line=True)


def _last_drawing(text: str) -> str | None:
    """What a line redrawn with carriage returns shows now: its last drawing (None: nothing drawn yet)."""
    drawings = text.split("\r")
    while drawings and not drawings[-1]:
        drawings.pop()
    return drawings[-1] if drawings else None


def _labelled(ranks: list[Key], lines: list[str]) -> str:
    """``[rank 3] text`` or ``[ranks 0-3,6] text`` for each line; an empty line is its label alone."""
    numbers = sorted(rank for rank in ranks if isinstance(rank, int))
    label = f"[rank {numbers[0]}]" if len(numbers) == 1 else f"[ranks {spans(numbers)}]"
    if "" in lines:
        return "".join(f"{label} {line}\n" if line else f"{label}\n" for line in lines)
    return f"{label} " + f"\n{label} ".join(lines) + "\n"


def spans(numbers: list[int]) -> str:
    """``0-3,6``: consecutive numbers as ranges."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
