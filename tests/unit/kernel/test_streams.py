"""Ranks' byte streams as the cell shows them: decoded, labelled per line, never mixed mid-line."""

from __future__ import annotations

import io
import sys

import pytest

from taas_magic.kernel.view.streams import (
    PARTIAL_LINE_DELAY,
    PARTIAL_LINE_MAX,
    TAIL_LINE_MAX,
    TAIL_LINES,
    RankOutput,
    write_to_cell,
)

T0 = 100.0
LATER = T0 + PARTIAL_LINE_DELAY + 0.05  # a moment past the delay, clear of float rounding


class Cell:
    """Collects what RankOutput writes, as the cell's streams would receive it."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def __call__(self, stream: str, text: str) -> None:
        self.writes.append((stream, text))

    def text(self, stream: str = "stdout") -> str:
        return "".join(text for name, text in self.writes if name == stream)


@pytest.fixture
def cell() -> Cell:
    return Cell()


def test_each_line_gets_its_rank_prefix(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"alpha\nbeta\n", now=T0)
    output.feed(1, "stdout", b"gamma\n", now=T0)
    output.feed(2, "stdout", b"delta\n\nepsilon\n", now=T0)
    assert cell.text() == ("[rank 0] alpha\n[rank 0] beta\n[rank 1] gamma\n[rank 2] delta\n\n[rank 2] epsilon\n")


def test_no_prefix_when_prefix_is_off(cell: Cell) -> None:
    output = RankOutput(cell, prefix=False)
    output.feed(0, "stdout", b"alpha\nbeta\n", now=T0)
    assert cell.writes == [("stdout", "alpha\nbeta\n")]


def test_hidden_rank_is_not_shown_but_its_stderr_tail_is_kept(cell: Cell) -> None:
    output = RankOutput(cell, prefix=False, shown={0})
    output.feed(0, "stdout", b"from 0\n", now=T0)
    output.feed(1, "stdout", b"from 1\n", now=T0)
    output.feed(1, "stderr", b"Traceback (most recent call last):\nValueError: boom\n", now=T0)
    output.feed(1, "stdout", b"partial", now=T0)
    output.flush_idle(LATER)
    output.finish()
    assert cell.writes == [("stdout", "from 0\n")]
    assert output.tail(1) == ["Traceback (most recent call last):", "ValueError: boom"]


def test_a_line_split_across_feeds_arrives_once_whole(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"hel", now=T0)
    output.feed(0, "stdout", b"lo wor", now=T0)
    assert cell.writes == []
    output.feed(0, "stdout", b"ld\nnext", now=T0)
    assert cell.writes == [("stdout", "[rank 0] hello world\n")]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_multibyte_characters_split_across_feeds_decode_whole(cell: Cell, size: int) -> None:
    text = "café 日本 🚀 ok\n"
    data = text.encode("utf-8")
    output = RankOutput(cell, prefix=True)
    for start in range(0, len(data), size):
        output.feed(0, "stdout", data[start : start + size], now=T0)
    assert cell.text() == "[rank 0] " + text
    assert "\ufffd" not in cell.text()


def test_invalid_bytes_are_replaced_not_raised(cell: Cell) -> None:
    output = RankOutput(cell, prefix=False)
    output.feed(0, "stdout", b"bad \xff byte\n", now=T0)
    output.feed(0, "stdout", b"cut \xe6\x97", now=T0)
    output.finish()
    assert cell.text() == "bad \ufffd byte\ncut \ufffd"


def test_partial_line_waits_for_the_rank_to_be_quiet(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"Loading", now=T0)
    output.flush_idle(T0 + PARTIAL_LINE_DELAY / 2)
    assert cell.writes == []
    output.flush_idle(LATER)
    assert cell.writes == [("stdout", "[rank 0] Loading")]
    output.flush_idle(LATER + 1)
    assert len(cell.writes) == 1  # nothing new: nothing written twice
    output.feed(0, "stdout", b"... done\n", now=LATER + 2)
    assert cell.text() == "[rank 0] Loading... done\n"


def test_more_text_restarts_the_quiet_period(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"a", now=T0)
    output.feed(0, "stdout", b"b", now=T0 + PARTIAL_LINE_DELAY * 0.8)
    output.flush_idle(T0 + PARTIAL_LINE_DELAY * 1.5)
    assert cell.writes == []
    output.flush_idle(T0 + PARTIAL_LINE_DELAY * 2)
    assert cell.writes == [("stdout", "[rank 0] ab")]


def test_finish_passes_on_what_is_held(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"zero, no newline", now=T0)
    output.feed(1, "stdout", b"one, no newline", now=T0)
    output.finish(1)
    assert cell.writes == [("stdout", "[rank 1] one, no newline")]
    output.finish()
    assert cell.text() == "[rank 1] one, no newline\n[rank 0] zero, no newline"
    output.finish()
    assert len(cell.writes) == 2


def test_carriage_return_progress_keeps_a_prefix_on_every_segment(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"\r 10%", now=T0)
    output.flush_idle(T0 + 1)
    output.feed(0, "stdout", b"\r 20%", now=T0 + 2)
    output.flush_idle(T0 + 3)
    output.feed(0, "stdout", b"\r100%\n", now=T0 + 4)
    text = cell.text()
    assert text == "\r[rank 0]  10%\r[rank 0]  20%\r[rank 0] 100%\n"
    assert all(segment.startswith("[rank 0] ") for segment in text.split("\r")[1:])


def test_carriage_returns_within_one_feed(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(1, "stderr", b"epoch 1  10%\repoch 1  50%\repoch 1 100%\n", now=T0)
    assert cell.text("stderr") == "[rank 1] epoch 1  10%\r[rank 1] epoch 1  50%\r[rank 1] epoch 1 100%\n"


def test_crlf_split_across_feeds_is_one_line_break(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"done\r", now=T0)
    assert cell.writes == []  # the \r may be the first half of \r\n: held
    output.feed(0, "stdout", b"\nnext\n", now=T0)
    assert cell.writes == [("stdout", "[rank 0] done\r\n[rank 0] next\n")]


def test_an_open_line_is_ended_before_another_rank_writes(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"epoch 1: ", now=T0)
    output.flush_idle(LATER)
    output.feed(1, "stdout", b"ready\n", now=LATER)
    output.feed(0, "stdout", b"loss 0.5\n", now=LATER)
    text = cell.text()
    assert text == "[rank 0] epoch 1: \n[rank 1] ready\n[rank 0] loss 0.5\n"
    assert all(line.startswith("[rank ") for line in text.splitlines())


def test_a_held_partial_line_is_not_mixed_with_another_rank(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"abc", now=T0)
    output.feed(1, "stdout", b"xyz\n", now=T0)
    output.feed(0, "stdout", b"def\n", now=T0)
    assert cell.text() == "[rank 1] xyz\n[rank 0] abcdef\n"


def test_stderr_is_kept_apart_from_stdout(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"out\n", now=T0)
    output.feed(0, "stderr", b"err\n", now=T0)
    assert cell.writes == [("stdout", "[rank 0] out\n"), ("stderr", "[rank 0] err\n")]
    # A line left open on stdout does not end a line on stderr, nor the other way round.
    output.feed(0, "stdout", b"half", now=T0)
    output.flush_idle(LATER)
    output.feed(1, "stderr", b"warning\n", now=LATER)
    output.feed(0, "stdout", b" line\n", now=LATER)
    assert cell.text("stdout") == "[rank 0] out\n[rank 0] half line\n"
    assert cell.text("stderr") == "[rank 0] err\n[rank 1] warning\n"
    assert output.tail(0) == ["err"]


def test_tail_keeps_whole_stderr_lines_across_feeds(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stderr", b"Traceback (most rec", now=T0)
    output.feed(0, "stderr", b'ent call last):\n  File "<cell>", line 3\n\nValueError: bo', now=T0)
    assert output.tail(0) == ["Traceback (most recent call last):", '  File "<cell>", line 3', "ValueError: bo"]
    output.feed(0, "stderr", b"om\r", now=T0)
    output.feed(0, "stderr", b"\n", now=T0)
    assert output.tail(0) == ["Traceback (most recent call last):", '  File "<cell>", line 3', "ValueError: boom"]
    assert output.tail(1) == []


def test_tail_keeps_only_the_last_lines(cell: Cell) -> None:
    output = RankOutput(cell, prefix=False)
    output.feed(0, "stderr", "".join(f"line {n}\n" for n in range(TAIL_LINES + 5)).encode(), now=T0)
    output.feed(0, "stderr", b"unfinished", now=T0)
    tail = output.tail(0)
    assert len(tail) == TAIL_LINES
    assert tail[-2:] == [f"line {TAIL_LINES + 4}", "unfinished"]


def test_a_line_that_never_ends_is_passed_on_in_bounded_pieces_labelled_once(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    for _ in range(40):
        output.feed(0, "stdout", b"x" * 10_000, now=T0)  # 400 KB without a line break, no pause
    assert cell.writes, "not held back until the rank pauses"
    assert max(len(text) for _, text in cell.writes) <= PARTIAL_LINE_MAX + 10_000 + len("[rank 0] ")
    output.feed(0, "stdout", b"\n", now=T0)
    assert cell.text() == "[rank 0] " + "x" * 400_000 + "\n"


def test_a_long_partial_line_still_keeps_a_trailing_carriage_return_for_its_line_feed(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    output.feed(0, "stdout", b"y" * (PARTIAL_LINE_MAX + 1) + b"\r", now=T0)
    output.feed(0, "stdout", b"\nnext\n", now=T0)
    assert cell.text() == "[rank 0] " + "y" * (PARTIAL_LINE_MAX + 1) + "\r\n[rank 0] next\n"


def test_stderr_lines_kept_for_crash_reports_are_cut_short(cell: Cell) -> None:
    output = RankOutput(cell, prefix=True)
    for _ in range(50):
        output.feed(1, "stderr", b"e" * 10_000, now=T0)
    output.feed(1, "stderr", b"\nRuntimeError: boom\n", now=T0)
    assert output.tail(1) == ["e" * TAIL_LINE_MAX, "RuntimeError: boom"]


def test_writing_to_the_cell_skips_a_write_set_on_the_stream_object_and_flushes(monkeypatch) -> None:
    class Stream(io.StringIO):
        flushed = 0

        def flush(self) -> None:
            self.flushed += 1

    stream, copies = Stream(), []
    stream.write = copies.append  # what IPython 9 sets while a cell runs, to keep a copy of everything
    monkeypatch.setattr(sys, "stdout", stream)
    write_to_cell("stdout", "[rank 0] hello\n")
    assert stream.getvalue() == "[rank 0] hello\n" and stream.flushed == 1
    assert copies == []
