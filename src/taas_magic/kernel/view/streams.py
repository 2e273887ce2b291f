"""Ranks' byte streams become the cell's output: decoded, labelled by rank, never mixed mid-line.

Text is passed on as soon as a line ends; a partial line (a prompt, a `\\r` progress bar) is
passed on once its rank has been quiet for a moment, so nothing waits for the run to end.
Carriage returns survive, each overwritten line keeping its label, so a tqdm bar renders as
one updating line in the notebook.

Nothing here grows with the amount of output: a line that never ends is passed on in pieces,
the stderr lines kept for crash reports are cut short, and ``write_to_cell`` hands each piece
to the kernel's stream at once, without IPython keeping a copy (see there).
"""

from __future__ import annotations

import codecs
import contextvars
import ctypes
import functools
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from taas_magic.wire.events import Key

PARTIAL_LINE_DELAY = 0.1  # seconds a rank's unfinished line waits for more text
PARTIAL_LINE_MAX = 64 * 1024  # characters of an unfinished line held back at most
TAIL_LINES = 20  # recent stderr lines kept per rank for crash reports
TAIL_LINE_MAX = 2000  # characters kept of each of those lines
WRITE_PIECE = 32 * 1024  # characters handed to the kernel's stream at once (see write_to_cell)
_BREAKS = re.compile(r"(\r\n|\n|\r)")
_OWN_STDERR: contextvars.ContextVar[Any] = contextvars.ContextVar("taas_own_stderr", default=None)


@dataclass
class StreamSource:
    """One rank's stdout or stderr."""

    prefix: str
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    pending: str = ""
    at_line_start: bool = True
    last_data: float = 0.0


@dataclass
class _Target:
    """One of the cell's output streams, and which source left its last line open."""

    write: Callable[[str], object]
    open_source: StreamSource | None = None

    def put(self, text: str, source: StreamSource | None, ends_line: bool) -> None:
        """Write ``text`` of ``source`` (None: lines of several ranks at once); a line another source
        left open is ended first, rather than mixed into."""
        if self.open_source not in (None, source):
            text = "\n" + text
            self.open_source.at_line_start = True
        self.write(text)
        self.open_source = None if ends_line else source


class RankOutput:
    """Feeds ranks' output into ``write(stream, text)``; shows the ranks in ``shown`` (all by default)."""

    def __init__(
        self,
        write: Callable[[str, str], object],
        prefix: bool,
        shown: Iterable[Key] | None = None,
        labels: Mapping[Key, str] | None = None,
    ):
        self._targets = {name: _Target(functools.partial(write, name)) for name in ("stdout", "stderr")}
        self._prefix = prefix
        self._shown = None if shown is None else set(shown)
        self._sources: dict[tuple[Key, str], StreamSource] = {}
        self._tails: dict[Key, deque[str]] = {}
        self._labels = labels or {}  # names of processes that are not ranks (data producers)
        self._tail_partial: dict[Key, str] = {}  # a stderr line whose end has not arrived yet

    def feed(self, rank: Key, stream: str, data: bytes, now: float | None = None) -> None:
        source = self._take(rank, stream, data, now)
        if source is None:
            return
        end = _complete_prefix_length(source.pending)
        if len(source.pending) - end > PARTIAL_LINE_MAX:  # a line that does not end: pass it on in pieces
            end = len(source.pending) - (1 if source.pending.endswith("\r") else 0)  # it may begin a \r\n
        if end:
            self._emit(source, stream, source.pending[:end])
            source.pending = source.pending[end:]

    def _take(self, rank: Key, stream: str, data: bytes, now: float | None) -> StreamSource | None:
        """Decode ``data`` onto its source's pending text (stderr kept for crash reports too); the source,
        or None when the rank is not shown."""
        source = self._source(rank, stream)
        text = source.decoder.decode(data)
        if stream == "stderr":
            self._keep_tail(rank, text)
        if not self._is_shown(rank):
            return None
        source.pending += text
        source.last_data = time.monotonic() if now is None else now
        return source

    def flush_idle(self, now: float | None = None) -> None:
        """Pass on partial lines whose rank has been quiet for ``PARTIAL_LINE_DELAY``."""
        now = time.monotonic() if now is None else now
        for (_, stream), source in self._sources.items():
            if source.pending and now - source.last_data >= PARTIAL_LINE_DELAY:
                self._emit(source, stream, source.pending)
                source.pending = ""

    def finish(self, rank: Key | None = None) -> None:
        """Pass on everything still held for ``rank`` (all ranks by default): the run is over for it."""
        for (source_rank, stream), source in self._sources.items():
            if rank is not None and source_rank != rank:
                continue
            text = source.pending + source.decoder.decode(b"", final=True)
            source.pending = ""
            if text and self._is_shown(source_rank):
                self._emit(source, stream, text)

    def exited(self, rank: Key) -> None:
        """The rank's process is gone: nothing more will come from it."""
        self.finish(rank)

    def tail(self, rank: Key) -> list[str]:
        """The last lines the rank wrote to stderr, shown or not: what a crash left behind."""
        lines = list(self._tails.get(rank, ()))
        partial = self._tail_partial.get(rank, "")
        if partial.strip():
            lines = (lines + [partial])[-TAIL_LINES:]
        return lines

    def _source(self, rank: Key, stream: str) -> StreamSource:
        key = (rank, stream)
        if key not in self._sources:
            label = self._labels.get(rank, f"rank {rank}")
            self._sources[key] = StreamSource(prefix=f"[{label}] " if self._prefix or rank in self._labels else "")
        return self._sources[key]

    def _is_shown(self, rank: Key) -> bool:
        return self._shown is None or rank in self._shown

    def _keep_tail(self, rank: Key, text: str) -> None:
        tail = self._tails.setdefault(rank, deque(maxlen=TAIL_LINES))
        # Chunks end anywhere, often mid-line: a line is kept whole once its line break arrives.
        lines = (self._tail_partial.pop(rank, "") + text).splitlines(keepends=True)
        if lines and lines[-1].splitlines() == [lines[-1]]:
            self._tail_partial[rank] = lines.pop()[:TAIL_LINE_MAX]
        for line in lines:
            line = line.splitlines()[0][:TAIL_LINE_MAX]
            if line.strip():
                tail.append(line)

    def _emit(self, source: StreamSource, stream: str, text: str) -> None:
        pieces = []
        for piece in _BREAKS.split(text):
            if not piece:
                continue
            if _BREAKS.fullmatch(piece):
                pieces.append(piece)
                source.at_line_start = True
            else:
                if source.at_line_start:
                    pieces.append(source.prefix)
                pieces.append(piece)
                source.at_line_start = False
        self._targets[stream].put("".join(pieces), source, ends_line=text.endswith("\n"))


def _complete_prefix_length(text: str) -> int:
    """Length of the part of ``text`` that ends at a line break (a lone trailing ``\\r`` may be half of ``\\r\\n``)."""
    end = max(text.rfind("\n"), text.rfind("\r", 0, len(text) - 1))
    return end + 1


def write_to_cell(stream: str, text: str) -> None:
    """Ranks' output goes where the running cell's own output goes, and nothing of it stays behind.

    Two things would keep it in the kernel's memory for good. IPython (9 and later) keeps a
    copy of every string a cell writes to ``sys.stdout``/``sys.stderr``, for ``%notebook``,
    through a ``write`` it sets on the stream object while the cell runs: rank output is
    written through the stream's own ``write`` instead. And ipykernel gathers what is written
    into one message per 0.2 s, so megabytes per second of output make messages of many
    megabytes whose buffers the allocator keeps after they are freed: each piece is flushed
    at once, so a message is never larger than one piece, and the cell's output keeps pace
    with what the kernel can send. A piece is at most ``WRITE_PIECE`` characters: the live view
    writes what several ranks printed within its window as one block, megabytes at times.
    """
    _write_in_pieces(sys.stdout if stream == "stdout" else sys.stderr, text)


def writer_to_this_cell() -> Callable[[str, str], None]:
    """``write_to_cell`` bound to the streams the cell has now: a run in the background goes on writing into its
    own cell while another cell has swapped ``sys.stdout`` for its own (``%%capture``, ``redirect_stdout``)."""
    out, err = sys.stdout, sys.stderr

    def write(stream: str, text: str) -> None:
        _write_in_pieces(out if stream == "stdout" else err, text)

    return write


def pin_stderr(stderr: Any) -> None:
    """From now on, in this thread's context (a run in the background's), taas's lines (``say``) go to ``stderr``,
    the run's own cell's, whatever another cell swaps ``sys.stderr`` for meanwhile (``%%capture``)."""
    _OWN_STDERR.set(stderr)


def say(line: str) -> None:
    """A line of taas's for the cell that runs now, on its stderr: a run in the background's own cell's
    (``pin_stderr``), else the notebook's current one."""
    target = _OWN_STDERR.get()
    _write_in_pieces(sys.stderr if target is None else target, line + "\n")


def _write_in_pieces(target: Any, text: str) -> None:
    for start in range(0, len(text), WRITE_PIECE):  # a block of many lines of several ranks, in pieces
        type(target).write(target, text[start : start + WRITE_PIECE])
        target.flush()


def give_back_freed_memory() -> None:
    """After a run, the pages its output freed go back to the system.

    Megabytes of output pass through the kernel as short-lived strings and messages, and glibc
    keeps the pages they freed in its heap for good: the kernel would stay that much larger after
    every run that printed much. ``malloc_trim`` returns them; other C libraries have no such call.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        trim = ctypes.CDLL(None).malloc_trim  # this process's own C library
    except (OSError, AttributeError):  # not glibc (musl)
        return
    trim(0)
