"""A process's Python stack as faulthandler dumps it, read: its threads and frames, the thread taas
handed the work to, and the lines a person reads (innermost user frame first, taas's own left out).

Pure text in, values and text out; the dump comes from SIGUSR1 (``process/child.py``).
"""

from __future__ import annotations

import linecache
import re
import sysconfig
from dataclasses import dataclass
from typing import Mapping

from taas_magic.wire.events import Key
from taas_magic.wire.records import RankActivity, split_position

FRAME_LINE = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>.+)$')
LIBRARIES = tuple(
    path
    for path in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    if path
)

# Where taas hands a process its work, by file and function (None: any function of the file): a rank's
# cell (run_cell, or the rank's setup before it), a forked process's start in its supervisor (a
# producer's loop is its work, and shown). Frames below are taas's. A file alone would not do: taas's
# wrappers of the user's calls (init_process_group's) live in those files too.
WORK_STARTS: tuple[tuple[str, str | None], ...] = (
    ("/taas_magic/rank/cell.py", "run_cell"),
    ("/taas_magic/rank/worker.py", "run_rank"),
    ("/taas_magic/launch/supervisor/tasks.py", "run_forked"),
    ("/taas_magic/launch/supervisor/ranks.py", None),
    ("/taas_magic/launch/supervisor/forking.py", None),
    ("/taas_magic/launch/fork/backend.py", None),
)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def user(self, cell_names: Mapping[str, str]) -> bool:
        """A frame of the notebook's cells or of the user's own files, not of Python, a library or taas."""
        if self.file in cell_names:
            return True
        return not (
            self.file.startswith(LIBRARIES)
            or "/site-packages/" in self.file
            or "/taas_magic/" in self.file
            or "/dist-packages/" in self.file
            or self.file.startswith("<")
        )

    def where(self, cell_names: Mapping[str, str]) -> str:
        """ "Cell In[7], line 12" or "train.py, line 30"."""
        label = cell_names.get(self.file)
        return f"{label}, line {self.line}" if label else f"{self.file}, line {self.line}"

    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()

    def starts_work(self) -> bool:
        return any(self.file.endswith(file) and function in (None, self.function) for file, function in WORK_STARTS)


@dataclass(frozen=True)
class Thread:
    main: bool  # the thread taas handed the process's work to (the cell's, or a producer's loop)
    frames: tuple[Frame, ...]  # most recent call first, cut where taas started the process's work


def parse_stacks(dump: str) -> list[Thread]:
    """A faulthandler dump as threads, the main one first, each cut where taas started the work.

    Other threads are kept only where they run the user's code: taas's own (the lifeline, the
    samplers) and libraries' helpers (a DataLoader's pin-memory thread) say nothing about a hang.
    """
    threads: list[Thread] = []
    current: list[bool] = []  # faulthandler's "Current thread": the one the signal landed in
    for block in dump.strip().split("\n\n"):
        lines = block.strip().splitlines()
        if not lines or not lines[0].lstrip().startswith(("Thread", "Current thread")):
            continue
        frames = [
            Frame(match["file"], int(match["line"]), match["function"].strip())
            for match in map(FRAME_LINE.match, lines[1:])
            if match
        ]
        cut = next((index for index, frame in enumerate(frames) if frame.starts_work()), None)
        # The signal that asked for the dump may land in any thread: faulthandler's "current thread" is
        # that one, not necessarily the main one. The main thread is the one taas started the work in.
        threads.append(Thread(cut is not None, tuple(frames[:cut])))
        current.append(lines[0].lstrip().startswith("Current thread"))
    if not any(thread.main for thread in threads):  # no taas frames: faulthandler's own guess, then
        threads = [Thread(guess, thread.frames) for guess, thread in zip(current, threads)]
    return [
        thread
        for thread in sorted(threads, key=lambda thread: not thread.main)
        if thread.main or any(frame.user({}) for frame in thread.frames)
    ]


def other_threads(dump: str) -> str:
    """A faulthandler dump without the thread taas handed the work to."""
    blocks = [
        block
        for block in dump.strip().split("\n\n")
        if not any(
            Frame(m["file"], 0, m["function"].strip()).starts_work()
            for m in map(FRAME_LINE.match, block.splitlines())
            if m
        )
    ]
    return "\n\n".join(block.replace("Current thread", "Thread", 1) for block in blocks)


def stack_lines(dump: str, cell_names: Mapping[str, str]) -> list[str]:
    """A process's stack, innermost user frame first: each user frame with its line of source, what it
    called inside libraries summed up in one line, taas's own frames left out."""
    lines: list[str] = []
    for thread in parse_stacks(dump):
        frames = [frame for frame in thread.frames if "/taas_magic/" not in frame.file]
        first_user = next((index for index, frame in enumerate(frames) if frame.user(cell_names)), None)
        if not thread.main:
            lines.append("    another thread:")
        if first_user:
            inner = frames[0]
            lines.append(f"    in {inner.function} ({_short(inner.file)}, line {inner.line}), called from:")
        last_user = max((index for index, frame in enumerate(frames) if frame.user(cell_names)), default=None)
        outermost = len(frames) if last_user is None or thread.main else last_user + 1  # a thread's own start is noise
        for frame in frames[first_user or 0 : outermost]:
            lines.append(f"    {_frame_text(frame, cell_names)}")
            source = frame.source() if frame.user(cell_names) else ""
            if source:
                lines.append(f"      {source}")
    return lines


def _frame_text(frame: Frame, cell_names: Mapping[str, str]) -> str:
    label = cell_names.get(frame.file)
    return (
        f"{label}, line {frame.line} in {frame.function}"
        if label
        else f'File "{frame.file}", line {frame.line} in {frame.function}'
    )


def _short(path: str) -> str:
    """A library file as it is imported: "torch/distributed/distributed_c10d.py"."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    for library in LIBRARIES:
        if path.startswith(library):
            return path[len(library) :].lstrip("/")
    return path


def reporting_failure(dump: str) -> bool:
    """The dump shows the process reporting a failure of its own (``rank/cell.py``'s ``_failure``): where it
    waited is gone, and what it does now says nothing of it."""
    return " in _failure" in dump


def split_positions(stacks: Mapping[Key, str]) -> tuple[dict[Key, RankActivity], dict[Key, str]]:
    """The positions the ranks sent with their stacks (``records.split_position``), and the stacks alone.

    A position is of the moment of its stacks: it is each such rank's latest sample, which the diagnosis
    reads with them (the periodic samples are up to a second older, and ranks in a fast loop seem far apart).
    Not that of a rank reporting its failure: its collective, broken, counts as finished, and its last sample
    says better where it waited.
    """
    positions: dict[Key, RankActivity] = {}
    alone: dict[Key, str] = {}
    for key, dump in stacks.items():
        position, alone[key] = split_position(dump)
        if position is not None and not reporting_failure(alone[key]):
            positions[key] = position
    return positions, alone
