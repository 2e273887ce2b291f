"""The live view's output rules: bars go to their rank's row, identical lines of several ranks are written once."""

from __future__ import annotations

from taas_magic.kernel.view.tidy_output import COLLAPSE_WINDOW, TidyRankOutput, spans

T0 = 1000.0
LATER = T0 + COLLAPSE_WINDOW + 0.01


class Cell:
    """What the cell's streams receive, and what the rows were told."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str]] = []
        self.bars: list[tuple[object, str]] = []

    def write(self, stream: str, text: str) -> None:
        self.written.append((stream, text))

    def bar(self, rank: object, text: str) -> None:
        self.bars.append((rank, text))

    def text(self, stream: str = "stdout") -> str:
        return "".join(text for name, text in self.written if name == stream)


def tidy(cell: Cell, ranks: int = 4, prefix: bool = True, shown: set[int] | None = None) -> TidyRankOutput:
    return TidyRankOutput(cell.write, prefix, ranks, cell.bar, shown)


def test_identical_lines_of_every_rank_are_written_once_at_once():
    cell = Cell()
    output = tidy(cell)
    for rank in range(4):
        output.feed(rank, "stderr", b"UserWarning: same\n", now=T0)
    assert cell.text("stderr") == "[ranks 0-3] UserWarning: same\n"  # every rank said it: no wait


def test_lines_that_differ_keep_their_own_labels_after_the_window():
    cell = Cell()
    output = tidy(cell, ranks=3)
    output.feed(0, "stdout", b"loss 0.5\n", now=T0)
    output.feed(2, "stdout", b"loss 0.5\n", now=T0)
    output.feed(1, "stdout", b"loss 0.7\n", now=T0)
    assert cell.text() == ""  # held: another rank may still say the same
    output.flush_idle(now=LATER)
    assert cell.text() == "[ranks 0,2] loss 0.5\n[rank 1] loss 0.7\n"


def test_each_ranks_lines_keep_their_order():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(0, "stdout", b"A\nB\n", now=T0)
    output.feed(1, "stdout", b"B\nA\n", now=T0)
    output.flush_idle(now=LATER)
    lines = cell.text().splitlines()
    assert lines == ["[rank 0] A", "[ranks 0-1] B", "[rank 1] A"]  # rank 0: A, B; rank 1: B, A


def test_a_rank_saying_the_same_twice_is_written_twice():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(0, "stdout", b"epoch\nepoch\n", now=T0)
    output.feed(1, "stdout", b"epoch\nepoch\n", now=T0)
    assert cell.text() == "[ranks 0-1] epoch\n[ranks 0-1] epoch\n"


def test_an_empty_line_is_labelled_too():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(0, "stdout", b"\n", now=T0)
    output.feed(1, "stdout", b"\n", now=T0)
    assert cell.text() == "[ranks 0-1]\n"


def test_a_bar_goes_to_its_row_and_its_final_drawing_once_to_the_output():
    cell = Cell()
    output = tidy(cell, ranks=1)
    for done in range(0, 101, 10):
        output.feed(0, "stderr", f"\r{done:3d}%|bar| {done}/100".encode(), now=T0)
    assert cell.text("stderr") == ""
    assert cell.bars[-1] == (0, "100%|bar| 100/100")
    assert [text for _, text in cell.bars][:2] == ["0%|bar| 0/100", "10%|bar| 10/100"]
    output.feed(0, "stderr", b"\n", now=T0)
    output.finish()
    assert cell.text("stderr") == "[rank 0] 100%|bar| 100/100\n"


def test_a_bar_redrawn_many_times_holds_only_its_latest_drawing():
    cell = Cell()
    output = tidy(cell, ranks=1)
    for step in range(100_000):
        output.feed(0, "stderr", f"\rstep {step}".encode(), now=T0)
    assert len(output._sources[(0, "stderr")].pending) < 100
    output.flush_idle(now=T0 + 10)
    assert cell.text("stderr") == ""  # a bar is not a prompt: it stays in its row, however long it is quiet
    output.finish()
    assert cell.text("stderr") == "[rank 0] step 99999\n"


def test_a_bar_that_erases_itself_leaves_nothing():
    cell = Cell()
    output = tidy(cell, ranks=1)
    output.feed(0, "stderr", b"\r 50%|bar|\r          \r", now=T0)
    output.feed(0, "stderr", b"next\n", now=T0)
    output.finish()
    assert cell.text("stderr") == "[rank 0] next\n"


def test_carriage_return_line_feed_is_an_ordinary_line_break():
    cell = Cell()
    output = tidy(cell, ranks=1)
    output.feed(0, "stdout", b"windows\r", now=T0)
    output.feed(0, "stdout", b"\nline\r\n", now=T0)
    output.finish()
    assert cell.text() == "[rank 0] windows\n[rank 0] line\n"
    assert cell.bars == []


def test_a_prompt_without_line_break_is_written_once_its_rank_is_quiet():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(1, "stdout", b"Name: ", now=T0)
    output.flush_idle(now=T0 + 0.2)
    assert cell.text() == "[rank 1] Name: "
    output.feed(1, "stdout", b"Ada\n", now=T0 + 0.3)
    output.finish()
    assert cell.text() == "[rank 1] Name: Ada\n"


def test_a_ranks_earlier_lines_come_before_its_prompt():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(1, "stdout", b"before\nName: ", now=T0)
    output.flush_idle(now=T0 + 0.15)
    assert cell.text() == "[rank 1] before\n[rank 1] Name: "


def test_only_rank_0_shown_is_written_unlabelled_and_without_waiting():
    cell = Cell()
    output = tidy(cell, prefix=False, shown={0})
    output.feed(0, "stdout", b"from 0\n", now=T0)
    output.feed(1, "stdout", b"from 1\n", now=T0)
    assert cell.text() == "from 0\n"


def test_finishing_one_rank_writes_its_lines_and_leaves_others_waiting():
    cell = Cell()
    output = tidy(cell, ranks=3)
    output.feed(0, "stdout", b"zero\n", now=T0)
    output.feed(1, "stdout", b"one\n", now=T0)
    output.finish(1)
    assert cell.text() == "[rank 1] one\n"
    output.finish()
    assert cell.text() == "[rank 1] one\n[rank 0] zero\n"


def test_a_line_every_rank_prints_collapses_even_after_lines_that_differ():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(0, "stdout", b"loss 0.5\nepoch done\n", now=T0)
    output.feed(1, "stdout", b"loss 0.7\nepoch done\n", now=T0 + 0.01)
    output.flush_idle(now=T0 + 0.02)
    output.flush_idle(now=LATER + 0.02)
    assert cell.text() == "[rank 0] loss 0.5\n[rank 1] loss 0.7\n[ranks 0-1] epoch done\n"


def test_unfinished_text_at_the_end_becomes_a_labelled_line():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(0, "stdout", b"no newline", now=T0)
    output.finish()
    assert cell.text() == "[rank 0] no newline\n"


def test_nothing_is_lost_when_many_ranks_print_many_lines():
    cell = Cell()
    output = tidy(cell, ranks=4)
    for rank in range(4):
        output.feed(rank, "stdout", "".join(f"rank {rank} line {i}\n" for i in range(2000)).encode(), now=T0)
        output.feed(rank, "stdout", b"shared\n" * 3, now=T0)
    output.finish()
    lines = cell.text().splitlines()
    for rank in range(4):
        own = [line for line in lines if line.startswith(f"[rank {rank}] rank {rank} line")]
        assert own == [f"[rank {rank}] rank {rank} line {i}" for i in range(2000)]
    assert lines.count("[ranks 0-3] shared") == 3


def test_spans():
    assert spans([0, 1, 2, 3]) == "0-3"
    assert spans([0, 2, 3, 4, 7]) == "0,2-4,7"
    assert spans([5]) == "5"


def test_a_rank_that_exited_still_shares_its_last_line_with_the_others():
    cell = Cell()
    output = tidy(cell, ranks=2)
    output.feed(0, "stdout", b"finished\n", now=T0)
    output.exited(0)
    assert cell.text() == ""
    output.feed(1, "stdout", b"finished\n", now=T0 + 0.01)
    assert cell.text() == "[ranks 0-1] finished\n"


def test_what_is_kept_to_compare_lines_stays_bounded_however_many_lines_pass():
    cell = Cell()
    output = tidy(cell, ranks=2)
    for chunk in range(300):
        text = "".join(f"step {chunk * 1000 + i}\n" for i in range(1000))
        output.feed(0, "stdout", text.encode(), now=T0 + chunk)  # each chunk a window after the last
    collapser = output._collapsers["stdout"]
    assert len(collapser.added[0]) <= 51_000 and len(collapser.taken[0]) <= 51_000
    output.finish()
    assert cell.text().count("\n") == 300_000


def nested_bars() -> bytes:
    """What tqdm writes for a bar with another below it (position=1, leave=False), as Lightning's
    training and validation bars do, when it writes to a pipe."""
    import io

    from tqdm import tqdm

    written = io.StringIO()
    for _ in tqdm(range(3), file=written, mininterval=0, ascii=True):
        for _ in tqdm(range(2), file=written, position=1, leave=False, mininterval=0, ascii=True):
            pass
    written.write("after\n")
    return written.getvalue().encode()


def test_a_bar_drawn_below_another_moves_the_cursor_and_leaves_no_lines():
    data = nested_bars()
    assert b"\x1b[A" in data
    for size in (len(data), 7, 1):  # however the pipe cut it
        cell = Cell()
        output = tidy(cell, ranks=1)
        for start in range(0, len(data), size):
            output.feed(0, "stderr", data[start : start + size], now=T0)
        output.finish()
        lines = cell.text("stderr").splitlines()
        assert len(lines) == 2 and lines[0].startswith("[rank 0] 100%|##########| 3/3"), (size, lines)
        assert lines[1] == "[rank 0] after"
        assert any("| 1/2 " in text for _, text in cell.bars), "the lower bar was shown in the rank's row"


def test_an_interrupt_anywhere_in_feeding_leaves_the_held_lines_consistent():
    """The controller catches an interrupt that lands in ``feed`` and goes on writing: whatever
    update it cut in two, later lines are collapsed and everything held is written at the end."""
    import random
    import sys

    from taas_magic.kernel.view import tidy_output

    for trial in range(150):
        pick = random.Random(trial)
        written: list[str] = []
        output = TidyRankOutput(lambda stream, text: written.append(text), True, 2, lambda rank, text: None)
        steps, at = [0], pick.randint(1, 2500)

        def interrupt_once(frame, event, arg):
            if event == "line" and frame.f_code.co_filename == tidy_output.__file__:
                steps[0] += 1
                if steps[0] == at:
                    raise KeyboardInterrupt
            return interrupt_once

        printed = [0, 0]  # both ranks print the same numbered lines, each at its own pace
        sys.settrace(interrupt_once)
        try:
            for step in range(300):
                rank, count = pick.randint(0, 1), pick.randint(1, 30)
                lines = "".join(f"line {i}\n" for i in range(printed[rank], printed[rank] + count))
                printed[rank] += count
                try:
                    output.feed(rank, "stdout", lines.encode(), now=step * 0.001)
                except KeyboardInterrupt:
                    pass
        finally:
            sys.settrace(None)
        output.feed(0, "stdout", b"after\n", now=2.0)
        output.feed(1, "stdout", b"after\n", now=2.0)
        output.finish()
        assert "[ranks 0-1] after\n" in "".join(written), f"trial {trial}"


def test_a_warning_every_rank_logs_in_cpp_is_one_line_whatever_its_time_stamps():
    """torch's C++ logging starts each line with its date and time: the same warning of every rank differs in
    them alone, and is written once, without them; what else a rank prints is left as it is."""
    cell = Cell()
    output = tidy(cell, ranks=2)
    for rank, time in ((0, b"09:22:22.586743355"), (1, b"09:22:23.000000001")):
        output.feed(
            rank,
            "stderr",
            b"[W1206 " + time + b" socket.cpp:955] [c10d] The hostname of the client socket cannot be retrieved\n"
            b"at [W1206 " + time + b" x] mid-line\n",
            now=T0,
        )
    output.flush_idle(now=LATER)
    assert cell.text("stderr").splitlines() == [
        "[ranks 0-1] [W socket.cpp:955] [c10d] The hostname of the client socket cannot be retrieved",
        "[rank 0] at [W1206 09:22:22.586743355 x] mid-line",
        "[rank 1] at [W1206 09:22:23.000000001 x] mid-line",
    ]
