"""A session in the kernel, driven by a scripted group of kept ranks: how its cells end, when the session
goes on and when it ends, what it says between cells.

The decisions are the run state machine's (test_run_state.py); here they meet the session that keeps
its ranks, its count of cells, the ranks to debug next and its group's end."""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Callable, Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.specs import cpu_spec

from taas_magic.errors import RankFailed, SessionEnded, TaasUsageError
from taas_magic.kernel.header import options
from taas_magic.kernel.magics import TaasMagics
from taas_magic.kernel.sessions.session import Session
from taas_magic.kernel.sessions.session_cells import check_fits_session
from taas_magic.kernel.view.front_end import CellFrontEnd
from taas_magic.per_rank import span
from taas_magic.rank import session as rank_session
from taas_magic.rank import worker
from taas_magic.wire.events import Event, Exited, Output, Report
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.records import CellEnded, Failed

Script = Callable[["ScriptedSessionGroup", list[int]], list[Event]]  # what the ranks do with a cell


class ScriptedSessionGroup:
    """Kept ranks that answer each cell as ``script`` says; records the cells and signals it was sent."""

    def __init__(self, script: Script, world_size: int = 2):
        self.script = script
        self.alive: set = set(range(world_size))
        self.waiting: list[Event] = []
        self.cells: list[list[int]] = []
        self.sent: list[SessionCell] = []
        self.signals: list[tuple[int, tuple[int, ...] | None]] = []
        self.on_signal: Callable[[ScriptedSessionGroup, int, Iterable[int] | None], list[Event]] = (
            lambda group, signum, ranks: []
        )
        self.dumps: dict[int, str] = {}
        self.closed = False

    def run_cell(self, cell: SessionCell, ranks: Iterable[int], fds: tuple[int, ...] = ()) -> None:
        self.cells.append(list(ranks))
        self.sent.append(cell)
        self.alive = cell.alive_after(self.alive, self.cells[-1])
        self.waiting += self.script(self, self.cells[-1])

    def events(self, timeout: float) -> list[Event]:
        batch, self.waiting = self.waiting, []
        for event in batch:
            if isinstance(event, Exited):
                self.alive.discard(event.rank)
        return batch

    def running(self) -> set:
        return set(self.alive)

    def signal(self, signum: int, ranks: Iterable[int] | None = None) -> None:
        self.signals.append((signum, None if ranks is None else tuple(ranks)))
        self.waiting += self.on_signal(self, signum, ranks)

    def stacks(self, ranks: Iterable[int], timeout: float) -> dict[int, str]:
        return {rank: self.dumps.get(rank, "") for rank in ranks}

    def nodes(self) -> frozenset:
        return frozenset()

    def answer(self, rank: int, line: str | None) -> None:
        raise AssertionError("no rank of these scripts asks for input")

    def close(self) -> None:
        self.closed = True
        self.alive.clear()


def each_rank_says(text: str) -> Script:
    def script(group: ScriptedSessionGroup, ranks: list[int]) -> list[Event]:
        events: list[Event] = []
        for rank in ranks:
            events += [Output(rank, "stdout", f"{text} {rank}\n".encode()), Report(rank, CellEnded(1.0))]
        return events

    return script


def session_of(group: ScriptedSessionGroup) -> Session:
    return Session(group, cpu_spec(len(group.alive)), "fork", known={}, sources_sent=set())


def run(session: Session, ranks: Iterable[int] = (0, 1)) -> list[tuple[str, str]]:
    written: list[tuple[str, str]] = []
    front = CellFrontEnd(lambda s, t: written.append((s, t)), read_line=input)
    session.run(SessionCell.post_mortem(), None, list(ranks), session.spec, front)
    return written


def test_a_cell_ends_when_its_ranks_say_so_and_the_same_ranks_run_the_next():
    group = ScriptedSessionGroup(each_rank_says("hello from"))
    session = session_of(group)
    assert run(session) == [("stdout", "[rank 0] hello from 0\n"), ("stdout", "[rank 1] hello from 1\n")]
    assert run(session, [1]) == [("stdout", "[rank 1] hello from 1\n")]
    assert group.cells == [[0, 1], [1]] and session.cells == 2
    assert not session.ended and not group.closed and group.signals == []
    assert session.check() == ""


def test_a_rank_that_raises_fails_the_cell_interrupts_the_others_and_the_session_goes_on():
    def script(group: ScriptedSessionGroup, ranks: list[int]) -> list[Event]:
        return [Report(1, Failed(2.0, "ValueError", "bad batch", ["tb"]))]

    group = ScriptedSessionGroup(script)
    group.on_signal = lambda g, signum, ranks: [
        Report(rank, Failed(3.0, "KeyboardInterrupt", "", ["tb"], interrupted=True)) for rank in ranks or ()
    ]
    session = session_of(group)
    with pytest.raises(RankFailed) as caught:
        run(session)
    assert str(caught.value) == "rank 1 failed: ValueError: bad batch"
    assert group.signals == [(signal.SIGINT, (0,))], "rank 0, still in the cell, is interrupted once"
    assert "taas: the session goes on (%taas debug opens the debugger in rank 1 at the error)" in caught.value.lines
    assert session.failed == [1] and not session.ended and not group.closed
    group.script = each_rank_says("again")
    assert run(session) == [("stdout", "[rank 0] again 0\n"), ("stdout", "[rank 1] again 1\n")]
    assert session.failed == [], "a cell that succeeds leaves no rank to debug"


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(2, 6),
    data=st.data(),
)
def test_the_cells_last_line_names_every_rank_a_new_process_replaces_and_the_one_to_debug(world, data):
    """Ranks killed together (an OOM killer's round), first or after a rank raised: the line that says the session
    goes on names each of them, and the raising rank for %taas debug; the group is reconnected with all of them
    new."""
    killed = data.draw(st.sets(st.integers(0, world - 1), min_size=0, max_size=world - 1), label="killed")
    raising = data.draw(st.sampled_from([None, *sorted(set(range(world)) - killed)]), label="raising")
    if not killed and raising is None:
        killed = {world - 1}
    events: list[Event] = [Exited(rank, -signal.SIGKILL) for rank in sorted(killed)]
    if raising is not None:
        events.insert(0, Report(raising, Failed(1.0, "ValueError", "bad batch", ["tb"])))
    survivors = [rank for rank in range(world) if rank not in killed and rank != raising]
    events += [Report(rank, CellEnded(2.0)) for rank in survivors]
    group = ScriptedSessionGroup(
        lambda g, ranks: events if len(g.cells) == 1 else [Report(r, CellEnded(3.0)) for r in ranks], world
    )
    group.on_signal = lambda g, signum, ranks: []
    session = session_of(group)
    front = CellFrontEnd(lambda stream, text: None, read_line=input)
    with pytest.raises(RankFailed) as caught:
        session.run(SessionCell.post_mortem(), None, list(range(world)), session.spec, front)
    line = caught.value.lines[-1]
    assert line.startswith("taas: the session goes on"), line
    if killed:
        assert f", a new process in place of {span(killed)}" in line, line
        assert group.sent[-1].newcomers == tuple(sorted(killed)), "each killed rank's place taken anew"
    else:
        assert "a new process" not in line, line
    if raising is not None:
        assert line.endswith(f"(%taas debug opens the debugger in rank {raising} at the error)"), line
    assert not session.ended


def test_a_rank_that_dies_in_a_cell_is_replaced_and_every_rank_reconnects_the_group():
    dying = [Report(0, CellEnded(1.0)), Exited(1, -signal.SIGKILL)]
    group = ScriptedSessionGroup(
        lambda g, ranks: dying if len(g.cells) == 1 else [Report(r, CellEnded(2.0)) for r in ranks]
    )
    session = session_of(group)
    shown: list[dict[str, str]] = []
    front = CellFrontEnd(lambda stream, text: None, read_line=input, status=lambda view, over: shown.append(view))
    with pytest.raises(RankFailed) as caught:
        session.run(SessionCell.post_mortem(), None, [0, 1], session.spec, front)
    assert str(caught.value) == "rank 1 failed: killed by signal SIGKILL"
    assert caught.value.lines[-1] == "taas: the session goes on, a new process in place of rank 1"
    summary = shown[-1]["text/plain"]
    assert re.search(r"rank 1 +replaced", summary) and re.search(r"rank 0 +done", summary), summary
    reconnect = group.sent[-1]
    assert (reconnect.regroup, reconnect.newcomers, group.cells[-1]) == (True, (1,), [0, 1]), "every rank, rank 1 new"
    assert not session.ended and not group.closed and session.failed == [], "a death leaves no error to debug"


def test_a_rank_that_dies_where_it_cannot_be_replaced_ends_the_session_and_closes_its_group():
    group = ScriptedSessionGroup(lambda g, ranks: [Report(0, CellEnded(1.0)), Exited(1, -signal.SIGKILL)])
    session = session_of(group)
    session.spec = dataclasses.replace(session.spec, device="cuda")  # NCCL: nothing releases its peers
    with pytest.raises(SessionEnded) as caught:
        run(session)
    assert (
        str(caught.value)
        == "taas: the session ended: rank 1 killed by signal SIGKILL: its process group cannot continue"
    )
    assert session.ended and group.closed
    with pytest.raises(SessionEnded, match="^the session ended: rank 1 killed by signal SIGKILL"):
        run(session)  # a later cell is told at once, nothing is sent
    assert group.cells == [[0, 1]]


def test_between_cells_what_a_rank_prints_shows_and_its_death_where_it_cannot_be_replaced_ends_the_session(capsys):
    group = ScriptedSessionGroup(each_rank_says("unused"))
    session = session_of(group)
    session.spec = dataclasses.replace(session.spec, device="cuda")  # NCCL: no rank is replaced
    group.waiting = [Output(1, "stdout", b"late line\n"), Exited(1, 3)]
    assert session.check() == "rank 1 exited with code 3 between cells"
    assert "[rank 1] late line" in capsys.readouterr().out
    assert group.closed and session.describe() == "ended: rank 1 exited with code 3 between cells"
    session.stop()  # stopping an ended session changes nothing
    assert session.ended == "rank 1 exited with code 3 between cells"


def test_a_rank_that_dies_between_cells_is_replaced_as_the_next_cell_begins(capsys):
    group = ScriptedSessionGroup(lambda g, ranks: [Report(rank, CellEnded(1.0)) for rank in ranks], world_size=3)
    session = session_of(group)
    session.failed = [1]
    group.waiting = [Exited(1, -signal.SIGKILL)]
    assert session.check() == "" and not group.closed
    assert capsys.readouterr().err == (
        "taas: rank 1 killed by signal SIGKILL between cells: a new process takes its place as the next taas cell "
        "begins\n"
    )
    assert session.failed == [], "its error went with it"
    run(session, [0, 2])
    reconnect, cell = group.sent
    assert (reconnect.regroup, reconnect.newcomers, group.cells[0]) == (True, (1,), [0, 1, 2]), "every rank heals it"
    assert cell == SessionCell.post_mortem() and group.cells[1] == [0, 2] and not session.dead
    group.waiting = [Exited(rank, -signal.SIGKILL) for rank in range(3)]
    assert session.check() == "every rank died between cells (rank 2 killed by signal SIGKILL between cells)"
    assert group.closed


def test_stop_ends_the_session_once_and_closes_its_group():
    group = ScriptedSessionGroup(each_rank_says("unused"))
    session = session_of(group)
    session.stop()
    assert session.ended == "stopped with %taas stop" and group.closed
    with pytest.raises(SessionEnded, match="the session ended: stopped with %taas stop"):
        run(session)


def idle_dump(*innermost: tuple[str, int, str]) -> str:
    """A kept rank's faulthandler dump between cells: waiting in its session loop for the next cell, in a
    call of the standard library's (the control channel's receive); ``innermost`` frames on top."""
    frames = [
        *innermost,
        ("/usr/lib/python3.12/socket.py", 573, "recv_fds"),
        (rank_session.__file__, 140, "_next_cell"),
        (rank_session.__file__, 66, "serve"),
        (worker.__file__, 60, "run_rank"),
        (worker.__file__, 20, "main"),
    ]
    return "Current thread 0x00007f0000000001 (most recent call first):\n" + "".join(
        f'  File "{file}", line {line} in {function}\n' for file, line, function in frames
    )


def test_where_says_once_that_every_idle_rank_waits_for_the_next_cell():
    group = ScriptedSessionGroup(each_rank_says("unused"))
    group.dumps = {0: idle_dump(), 1: idle_dump()}
    assert session_of(group).where({}) == ["ranks 0-1: idle, waiting for the next cell"]


def test_where_shows_a_rank_whose_main_thread_runs_a_librarys_code_as_not_idle():
    group = ScriptedSessionGroup(each_rank_says("unused"))
    library = ("/opt/venv/lib/python3.12/site-packages/torch/distributed/rendezvous.py", 90, "_wait")
    group.dumps = {0: idle_dump(), 1: idle_dump(library)}
    shown = session_of(group).where({})
    assert shown[0] == "rank 0: idle, waiting for the next cell"
    assert shown[1].startswith("rank 1: in no collective") and any("rendezvous.py" in line for line in shown), shown


def test_where_of_an_ended_session_says_why():
    group = ScriptedSessionGroup(each_rank_says("unused"))
    session = session_of(group)
    session.stop("the idle limit passed")
    assert session.where({}) == ["taas: the session ended: the idle limit passed"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("--gpus 4", "--gpus 4: the session has 2 ranks: %taas resize 4 changes them (its names kept)"),
        ("--gpus 4 --start forkserver", "--gpus, --start would change the running session (2 ranks on cpu)"),
        ("--device cuda --start fork", "--device would change the running session"),
        ("--start forkserver", "--start would change the running session"),
        (
            "--cpus 2",
            "--cpus cannot apply to a cell in a session: a cell there takes --ranks, --return, --from, --timeout, "
            "--hang-after, --output, --debug-ranks and --profile (%taas stop ends the session)",
        ),
        ("--max-restarts 1 --idle 60", "--max-restarts, --idle cannot apply to a cell in a session"),
    ],
)
def test_an_option_a_session_cell_cannot_take_is_one_line_naming_it(line, message):
    session = session_of(ScriptedSessionGroup(each_rank_says("unused")))
    with pytest.raises(TaasUsageError) as caught:
        check_fits_session(options.parse(TaasMagics.taas, line), session)
    assert str(caught.value).startswith(message), str(caught.value)


@pytest.mark.parametrize(
    "line",
    [
        "",
        "--gpus 2 --start fork",
        "--ranks 1 --return x --from all --timeout 5 --hang-after 2 --output rank0",
        "--debug-ranks 0",
        "--profile --ranks 1",
    ],
)
def test_the_options_a_session_cell_takes_pass(line):
    session = session_of(ScriptedSessionGroup(each_rank_says("unused")))
    check_fits_session(options.parse(TaasMagics.taas, line), session)


def test_profile_fits_a_cluster_sessions_cell_as_any_other():
    session = Session(
        ScriptedSessionGroup(each_rank_says("unused")), cpu_spec(2), "cluster", known={}, sources_sent=set()
    )
    check_fits_session(options.parse(TaasMagics.taas, "--profile --ranks 1"), session)
