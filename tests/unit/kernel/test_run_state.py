"""The run state machine, driven by synthetic events and a synthetic clock: no process, no group, no kernel.

What it decides (signals, stacks, prompts, the end of a session), the result it hands back, and the
words ``render`` makes of that result, for one-shot cells and session cells alike.
"""

from __future__ import annotations

import dataclasses
import linecache
import re
import signal
import sysconfig

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taas_magic.errors import RankFailed, RunInterrupted, RunTimedOut, SessionEnded
from taas_magic.kernel.diagnosis.hang import Hang, Process
from taas_magic.kernel.diagnosis.stacks import stack_lines
from taas_magic.kernel.run.run_actions import (
    Answer,
    AskLine,
    EndSession,
    MarkEnded,
    ShowHang,
    ShowView,
    Signal,
    TakeStacks,
    Why,
)
from taas_magic.kernel.run.run_result import ONE_SHOT, RELEASE_SECONDS, SESSION, STOP_SECONDS, EndCause, Outcome
from taas_magic.kernel.run.run_state import Phase, RunState
from taas_magic.kernel.run.run_stop import StopCause
from taas_magic.kernel.view import render
from taas_magic.rank import cell
from taas_magic.wire.events import Producer
from taas_magic.wire.rank_control import STOP_TOGETHER
from taas_magic.wire.records import (
    CellEnded,
    Collective,
    DeliverySummary,
    Failed,
    RankActivity,
    RankProgress,
    SavedOnNode,
    SaveSkipped,
    position_line,
)

RED, BOLD, RESET = "\x1b[0;31m", "\x1b[1m", "\x1b[0m"
BOTH = {0, 1}
CELL = "/tmp/ipykernel_1/2.py"
C10D = f"{sysconfig.get_paths()['purelib']}/torch/distributed/distributed_c10d.py"
ALL_REDUCE = ((C10D, 2501, "all_reduce"), (CELL, 4, "<module>"))


def failed(when: float, name: str = "ValueError", interrupted: bool = False) -> Failed:
    return Failed(when, name, "x", [f"tb at {when}"], interrupted=interrupted)


def dump(*frames: tuple[str, int, str]) -> str:
    """A rank's faulthandler dump: the cell's thread, its frames down to where taas ran the cell."""
    return (
        "Current thread 0x00007f0000000001 (most recent call first):\n"
        + "".join(f'  File "{file}", line {line} in {function}\n' for file, line, function in frames)
        + f'  File "{cell.__file__}", line 40 in run_cell\n'
    )


def sample(
    at: float,
    cpu: float = 0.0,
    finished: int = 4,
    seq: int | None = None,
    seconds: float = 1.0,
    taken: int = 0,
    waiting: str = "",
    setup: float | None = None,
) -> RankActivity:
    """A rank's activity at ``at``: in all_reduce ``seq`` (for ``seconds``) if given, after ``finished``."""
    collectives = [] if seq is None else [Collective("0", seq, "all_reduce", [[1000]], ["Float"], seconds)]
    return RankActivity(at, cpu, {"0": finished}, collectives, waiting, 0.0, taken, setup)


def one_shot(**kwargs) -> RunState:
    return RunState(ONE_SHOT, 0.0, **kwargs)


def session(ranks=(0, 1), **kwargs) -> RunState:
    return RunState(SESSION, 0.0, ranks=ranks, **kwargs)


# -- one-shot cells -------------------------------------------------------------------------------
def test_a_run_whose_ranks_all_finish_is_done_and_over_once_they_exited():
    state = one_shot()
    assert not state.over(BOTH) and state.phase is Phase.RUNNING
    for rank in (0, 1):
        state.reported(rank, CellEnded(1.0))
        assert state.exited(rank, 0, 1.0) == [MarkEnded(rank, "done")]
    state.result_sent(0, b"names")
    assert state.tick(1.0, set()) == []
    assert state.over(set()) and state.phase is Phase.OVER
    result = state.result()
    assert (result.outcome, result.results, result.failures) == (Outcome.DONE, {0: b"names"}, ())
    assert render.error(result, {}) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.outcome = Outcome.FAILED  # type: ignore[misc]


def test_a_failure_stops_the_others_with_sigterm_then_sigkill_3_s_later():
    state = one_shot()
    state.reported(1, failed(0.5))
    assert state.exited(1, 1, 0.6) == [MarkEnded(1, "failed")]
    asked, *signals = state.tick(1.0, {0})  # where the others are, before the signals move them
    assert (asked, signals) == (TakeStacks((0,), Why.STOP), [Signal(signal.SIGTERM, (0,))])
    assert state.stacks_taken(asked, {}, 1.0, {0}) == []  # the stop goes on
    assert state.phase is Phase.STOPPING and state.stop is not None and state.stop.cause is StopCause.FAILURE
    assert state.tick(3.9, {0}) == []
    assert state.tick(4.0, {0}) == [Signal(signal.SIGKILL, (0,))]
    assert state.exited(0, -signal.SIGKILL, 4.1) == [MarkEnded(0, "stopped")]
    assert state.tick(10.0, set()) == [] and state.over(set())
    result = state.result()
    assert result.outcome is Outcome.FAILED and [f.rank for f in result.failures] == [1]
    error = render.error(result, {})
    assert isinstance(error, RankFailed) and str(error) == "rank 1 failed: ValueError: x"
    assert error.lines == [
        f"{RED}{BOLD}taas: rank 1 failed: ValueError: x{RESET}",
        f"{BOLD}rank 1's traceback:{RESET}",
        "tb at 0.5",
        "stopped after the failure: rank 0",
    ]


REPORTING = ((cell.__file__, 80, "_failure"),) + ALL_REDUCE  # a rank formatting the error its collective raised


def broken(when: float) -> Failed:
    """What gloo makes a rank raise when the peer of its all_reduce exits: its record, as the rank sends it."""
    return Failed(
        when,
        "RuntimeError",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:61100",
        ["gloo's traceback"],
        peer_lost=True,
        stack=dump(*ALL_REDUCE),
    )


def drive(state: RunState, order: list[int], world: int) -> list[str]:
    """Rank 1 fails while the others wait for it in all_reduce #5; each of them then raises gloo's error and
    exits. ``order`` says whose next event taas sees next (-1: the clock ticks). The cell's lines, seconds as N."""
    for rank in range(world):
        state.reported(rank, sample(0.2, seq=None if rank == 1 else 5, seconds=0.1), 0.2)
    events = {
        rank: [("report", broken(0.6 + rank / 100) if rank != 1 else failed(0.5)), ("exit", 1)] for rank in range(world)
    }
    running, now = set(range(world)), 0.6
    for who in order + sorted(range(world)) * 2:  # what the order left: in one batch, maybe with no tick at all
        now += 0.01
        if who == -1:
            for action in state.tick(now, running):
                if isinstance(action, TakeStacks):  # a rank still running is in all_reduce, or reporting already
                    stacks = {
                        key: dump(*(REPORTING if key in state.ledger.records else ALL_REDUCE)) for key in action.keys
                    }
                    state.stacks_taken(action, stacks, now, running)
            continue
        if not events[who]:
            continue
        kind, what = events[who].pop(0)
        if kind == "report":
            state.reported(who, what, now)
        else:
            running.discard(who)
            state.exited(who, what, now, ["last line"])
    assert state.over(set())  # the pump asks this before each tick: the run may end with no tick after a failure
    error = render.error(state.result(), {CELL: "Cell In[2]"})
    assert isinstance(error, RankFailed)
    return [re.sub(r" for \d+ s", "", line) for line in error.lines]  # under a second, no duration is said


@settings(max_examples=40, deadline=None)
@given(world=st.sampled_from([3, 4]), data=st.data())
def test_what_a_failure_reports_does_not_depend_on_which_event_came_first(world, data):
    """gloo breaks the others' collective as rank 1 exits; their errors, rank 1's record and the exits reach
    taas in any order, with the clock ticking (taas stopping the others) in between: the words are the same."""
    order = data.draw(st.lists(st.sampled_from([-1, *range(world)]), max_size=4 * world))
    lines = drive(one_shot(), order, world)
    peers = "0,2" if world == 3 else "0,2-3"
    assert lines[:3] == [
        f"{RED}{BOLD}taas: rank 1 failed: ValueError: x{RESET}",
        f"{BOLD}rank 1's traceback:{RESET}",
        "tb at 0.5",
    ], lines
    assert lines[3:6] == [
        f"stopped after the failure: ranks {peers}",
        f"{BOLD}where they were when rank 1 failed:{RESET}",
        f"ranks {peers}: in all_reduce #5 (4 KB float32):",
    ], lines
    assert not any("Connection" in line or "also failed" in line for line in lines), lines


def test_a_rank_killed_before_taas_signalled_it_is_the_root_cause_though_its_peers_errors_came_first():
    state = one_shot()
    state.reported(0, broken(0.6), 0.6)
    state.exited(0, 1, 0.7)
    asked, *_ = state.tick(0.8, {1})  # rank 0's error alone so far: the stop begins, rank 1 among those stopped
    state.stacks_taken(asked, {}, 0.8, {1})
    state.exited(1, -signal.SIGKILL, 0.81)  # killed from outside (the OOM killer): taas sent SIGTERM, not that
    result = state.result()
    assert [f.rank for f in result.failures] == [1] and [f.rank for f in result.broken] == [0]
    error = render.error(result, {CELL: "Cell In[2]"})
    assert str(error) == "rank 1 failed: killed by signal SIGKILL"
    assert error.lines[1:] == [
        "stopped after the failure: rank 0",
        f"{BOLD}where they were when rank 1 failed:{RESET}",
        "rank 0: in all_reduce:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
        "    Cell In[2], line 4 in <module>",
    ]
    assert error.peer_errors == {
        0: "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection "
        "closed by peer [127.0.0.1]:61100"
    }


def test_a_broken_connection_with_no_failure_behind_it_is_the_failure_shown():
    """A peer that left without failing (os._exit(0)) broke the collective: the broken rank's error is all there is."""
    state = one_shot()
    state.exited(1, 0, 0.5)
    state.reported(0, broken(0.6), 0.6)
    state.exited(0, 1, 0.7)
    error = render.error(state.result(), {})
    assert str(error).startswith("rank 0 failed: RuntimeError: [../third_party/gloo") and not error.peer_errors
    assert error.lines[1] == f"{BOLD}before rank 0 failed: rank 1 exited with code 0 before the cell finished{RESET}"


def test_an_interrupt_escalates_and_another_skips_to_the_next_signal():
    state = RunState(ONE_SHOT, 100.0)
    assert state.interrupt(100.0, BOTH) == [TakeStacks((0, 1), Why.STOP)]  # the first signal goes with the next tick
    assert state.phase is Phase.STOPPING and state.stop is not None and state.stop.cause is StopCause.INTERRUPT
    assert state.tick(100.05, BOTH) == [Signal(signal.SIGINT, (0, 1))]
    assert state.tick(102.9, BOTH) == []
    assert state.tick(103.0, BOTH) == [Signal(signal.SIGTERM, (0, 1))]
    assert state.interrupt(103.5, BOTH) == [Signal(signal.SIGKILL, None)]
    assert state.tick(200.0, BOTH) == [] and state.interrupt(200.0, BOTH) == []


def test_an_interrupt_while_stopping_for_a_failure_starts_the_interrupt_escalation():
    state = one_shot()
    state.reported(1, failed(0.5))
    state.exited(1, 1, 0.5)
    assert state.tick(1.0, {0}) == [TakeStacks((0,), Why.STOP), Signal(signal.SIGTERM, (0,))]
    assert state.interrupt(1.5, {0}) == [TakeStacks((0,), Why.STOP)]
    assert state.tick(1.55, {0}) == [Signal(signal.SIGINT, (0,))]
    assert state.result().outcome is Outcome.INTERRUPTED  # a one-shot cell says an interrupt first


def test_the_interrupted_message_says_how_each_rank_stopped():
    state = one_shot()
    state.reported(0, CellEnded(1.0))
    state.exited(0, 0, 1.0)
    state.interrupt(2.0, {1})
    state.reported(1, failed(2.1, "KeyboardInterrupt", interrupted=True))
    state.exited(1, 1, 2.2)
    result = state.result()
    assert result.failures == ()  # taas interrupted it: no failure
    error = render.error(result, {})
    assert isinstance(error, RunInterrupted)
    assert error.lines == [
        f"{RED}{BOLD}KeyboardInterrupt{RESET}: taas run interrupted; every rank stopped "
        "(rank 0: had finished; rank 1: KeyboardInterrupt)"
    ]


def test_the_earliest_failure_is_the_root_cause_and_a_crash_shows_its_last_stderr_lines():
    state = one_shot()
    state.reported(1, failed(20.0, "RuntimeError"))
    state.exited(1, 1, 20.0)
    state.exited(0, -signal.SIGSEGV, 21.0, ["Segmentation fault"])
    state.reported(Producer(0, 0), failed(10.0, "OSError"))
    state.exited(Producer(0, 0), 1, 22.0)
    state.labels[Producer(0, 0)] = "producer 0 of train_loader"
    result = state.result()
    assert [f.rank for f in result.failures] == [Producer(0, 0), 1, 0]
    message, lines = render.failure(result, "stopped")
    assert message == "producer 0 of train_loader failed: OSError: x"
    assert lines[-1] == (
        "also failed, after producer 0 of train_loader: rank 1 (RuntimeError: x); rank 0 (killed by signal SIGSEGV)"
    )
    crash = dataclasses.replace(result, failures=result.failures[2:])
    assert render.failure(crash, "stopped")[1][1:3] == [
        f"{BOLD}last lines rank 0 wrote to stderr:{RESET}",
        "Segmentation fault",
    ]


def test_producers_left_alone_are_retired_and_never_fail_the_cell():
    producer = Producer(0, 0)
    state = one_shot()
    for rank in (0, 1):
        state.reported(rank, CellEnded(1.0))
        state.exited(rank, 0, 1.0)
    assert state.tick(1.0, {producer}) == [Signal(signal.SIGTERM, (producer,))]
    assert state.stop is not None and state.stop.cause is StopCause.FINISHED
    state.reported(producer, failed(1.1, "RuntimeError"))  # its DataLoader's workers died of the stop first
    state.exited(producer, 1, 1.2)
    assert state.result().outcome is Outcome.DONE


def test_a_timeout_takes_the_late_ranks_stacks_and_stops_them(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(linecache.cache, CELL, (0, None, ["import time\n", "\n", "time.sleep(600)\n"], CELL))
    state = one_shot(deadline=10.0, timeout=10.0)
    assert state.tick(9.9, BOTH) == []
    state.reported(0, CellEnded(9.95))  # rank 0 sends its names back: not late
    asked = state.tick(10.0, BOTH)
    assert asked == [TakeStacks((1,), Why.LATE)]
    stack = dump((CELL, 3, "<module>"))
    assert state.stacks_taken(asked[0], {1: stack}, 10.5, BOTH) == [Signal(signal.SIGTERM, (0, 1))]
    result = state.result()
    assert result.outcome is Outcome.TIMED_OUT and result.late == {1: stack}
    error = render.error(result, {CELL: "Cell In[2]"})
    assert isinstance(error, RunTimedOut)
    assert str(error) == "--timeout 10 s elapsed: rank 1 still running, now stopped"
    assert error.lines == [
        f"{RED}{BOLD}taas: --timeout 10 s elapsed: rank 1 still running, now stopped{RESET}",
        f"{BOLD}before the time ran out: rank 0 had finished the cell{RESET}",
        f"{BOLD}where the processes were when the time ran out:{RESET}",
        "rank 0: had finished the cell",
        "rank 1: in no collective:",
        "    Cell In[2], line 3 in <module>",
        "      time.sleep(600)",
    ]


def test_late_ranks_at_the_same_place_are_shown_once_and_one_that_sent_no_stack_says_so():
    state = one_shot(deadline=10.0, timeout=10.0)
    ranks = {0, 1, 2}
    asked = state.tick(10.0, ranks)
    assert asked == [TakeStacks((0, 1, 2), Why.LATE)]
    state.stacks_taken(asked[0], {0: dump((CELL, 3, "<module>")), 2: dump((CELL, 3, "<module>"))}, 10.5, ranks)
    error = render.error(state.result(), {CELL: "Cell In[2]"})
    assert isinstance(error, RunTimedOut)
    assert error.lines[1:] == [
        f"{BOLD}where the processes were when the time ran out:{RESET}",
        "ranks 0,2: in no collective:",
        "    Cell In[2], line 3 in <module>",
        "rank 1: in no collective",
        "    (no stack received)",
    ]


def test_a_rank_that_ended_its_cell_while_its_stack_was_taken_is_not_late():
    state = one_shot(deadline=10.0, timeout=10.0)
    asked = state.tick(10.0, BOTH)
    assert asked == [TakeStacks((0, 1), Why.LATE)]
    state.reported(1, CellEnded(10.1))
    assert state.stacks_taken(asked[0], {}, 10.2, BOTH) == [Signal(signal.SIGTERM, (0, 1))]
    assert state.late == {0: ""}
    for rank in (0, 1):  # everything ended meanwhile: nobody is late, nothing is stopped
        fresh = one_shot(deadline=10.0)
        asked = fresh.tick(10.0, BOTH)
        fresh.reported(0, CellEnded(10.1))
        fresh.reported(1, CellEnded(10.1))
        assert fresh.stacks_taken(asked[0], {}, 10.2, BOTH) == [] and fresh.late is None


def test_a_debugger_prompt_is_shown_and_its_time_does_not_count_toward_the_timeout():
    state = one_shot(deadline=10.0)
    assert state.input_requested(0, "(Pdb) ") == [AskLine(0, "(Pdb) ")]
    state.waited(30.0)
    assert state.deadline == 40.0 and state.tick(39.0, BOTH) == []


def test_a_prompt_while_stopping_is_answered_quit_and_its_rank_counts_as_stopped():
    state = one_shot()
    state.reported(1, failed(0.5))
    assert state.input_requested(0, "(Pdb) ") == [AskLine(0, "(Pdb) ")]  # a one-shot rank failed once it exited
    state.exited(1, 1, 0.6)
    assert state.input_requested(0, "(Pdb) ") == [Answer(0, "quit")]
    assert 0 in state.stopped


def test_quitting_a_debugger_interrupts_the_run_and_is_no_failure_to_restart():
    state = one_shot()
    state.reported(0, Failed(1.0, "BdbQuit", ""))
    assert state.tick(1.0, BOTH) == [TakeStacks((0, 1), Why.STOP), Signal(signal.SIGINT, (0, 1))]
    state.exited(0, 1, 1.1)
    state.reported(1, failed(1.2, "KeyboardInterrupt", interrupted=True))
    state.exited(1, 1, 1.3)
    result = state.result()
    assert result.outcome is Outcome.INTERRUPTED and result.failures == ()
    assert "0: quit the debugger" in render.interrupted(result)[0]


def test_debug_pauses_the_first_rank_that_raised_and_stops_the_others():
    state = one_shot(debug=True)
    state.reported(1, failed(0.5))
    assert state.paused == {1}
    assert state.tick(1.0, BOTH) == [TakeStacks((0,), Why.STOP), Signal(signal.SIGTERM, (0,))]
    state.exited(0, -signal.SIGTERM, 1.1)
    assert state.over({1})  # the paused rank waits for %taas debug
    result = state.result()
    assert result.outcome is Outcome.FAILED and [f.rank for f in result.failures] == [1]


def test_the_view_is_drawn_after_half_a_second_at_most_every_quarter_second():
    state = one_shot()
    assert state.view(0.4, changed=True) == []
    assert state.view(0.5, changed=True) == [ShowView(0.5)]
    assert state.view(0.7, changed=True) == []
    assert state.view(0.8, changed=False) == []
    assert state.view(0.8, changed=True) == [ShowView(0.8)]


def test_one_shot_notices_say_saves_on_nodes_skipped_saves_and_deliveries():
    state = one_shot()
    state.reported(0, SavedOnNode("/data/model.pt", "10.0.0.2"))
    state.reported(1, SaveSkipped("model.pt"))
    delivery = {"train_loader": DeliverySummary(taken=100, waited=0.5, first_wait=0.01, span=2.0)}
    state.reported(0, CellEnded(1.0, delivery=delivery))
    assert render.notices(state.result()) == [
        "taas: rank 0 saved /data/model.pt on node 10.0.0.2: a file saved under an absolute path stays on its node "
        "(save under a relative path to have it copied here)",
        "taas: torch.save to 'model.pt' skipped in rank 1: only rank 0 writes files (guard other writes with "
        "taas.is_main())",
        "taas: train_loader: 100 elements delivered to 1 rank, 50 elements/s, ranks waited for data 25% of the "
        "time (first element after 10 ms)",
    ]
    session_cell = session()
    session_cell.reported(1, SaveSkipped("model.pt"))
    session_cell.reported(0, CellEnded(1.0, delivery=delivery))
    assert [line.split(":")[1] for line in render.notices(session_cell.result())] == [" train_loader"]


def test_a_restart_is_announced_with_the_one_line_failure():
    state = one_shot()
    state.reported(1, failed(0.5))
    state.exited(1, 1, 0.5)
    assert (
        render.restarting(state.result(), 1, 2)
        == "taas: rank 1 failed: ValueError: x: every rank starts again (restart 1 of --max-restarts 2)\n"
    )


# -- where the processes were when taas stopped them ---------------------------------------------
def test_a_failure_shows_where_the_ranks_it_stopped_were_waiting():
    state = one_shot()
    state.reported(0, sample(0.5, seq=5, seconds=2.0), 0.5)
    state.reported(1, failed(0.8))
    state.exited(1, 1, 0.9)
    asked, _ = state.tick(1.5, {0})
    assert asked == TakeStacks((0,), Why.STOP)
    state.stacks_taken(asked, {0: dump(*ALL_REDUCE)}, 1.5, {0})
    state.exited(0, -signal.SIGTERM, 1.6)
    error = render.error(state.result(), {CELL: "Cell In[2]"})
    assert isinstance(error, RankFailed)
    assert error.lines[3:] == [
        "stopped after the failure: rank 0",
        f"{BOLD}where they were when rank 1 failed:{RESET}",
        "rank 0: in all_reduce #5 (4 KB float32) for 3 s:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
        "    Cell In[2], line 4 in <module>",
    ]


def test_a_failure_does_not_show_where_ranks_that_were_not_waiting_were():
    state = one_shot()
    state.reported(0, sample(0.5, cpu=0.4), 0.5)  # computing: the failure stopped it, nothing held it
    state.reported(1, failed(0.8))
    state.exited(1, 1, 0.9)
    asked, _ = state.tick(1.5, {0})
    state.stacks_taken(asked, {0: dump((CELL, 3, "<module>"))}, 1.5, {0})
    state.exited(0, -signal.SIGTERM, 1.6)
    error = render.error(state.result(), {CELL: "Cell In[2]"})
    assert isinstance(error, RankFailed) and error.lines[-1] == "stopped after the failure: rank 0"


def test_an_interrupt_shows_where_the_ranks_were():
    state = one_shot()
    for rank in (0, 1):
        state.reported(rank, sample(0.5, seq=5, seconds=0.5), 0.5)
    [asked] = state.interrupt(1.0, BOTH)
    assert asked == TakeStacks((0, 1), Why.STOP)
    assert state.stacks_taken(asked, {0: dump(*ALL_REDUCE), 1: dump(*ALL_REDUCE)}, 1.0, BOTH) == []
    assert state.tick(1.05, BOTH) == [Signal(signal.SIGINT, (0, 1))]
    for rank in (0, 1):
        state.reported(rank, failed(1.1, "KeyboardInterrupt", interrupted=True))
        state.exited(rank, 1, 1.2)
    error = render.error(state.result(), {CELL: "Cell In[2]"})
    assert isinstance(error, RunInterrupted)
    assert error.lines[1:] == [
        f"{BOLD}where the ranks were when interrupted:{RESET}",
        "ranks 0-1: in all_reduce #5 (4 KB float32) for 1 s:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
        "    Cell In[2], line 4 in <module>",
    ]


# -- session cells --------------------------------------------------------------------------------
def test_a_session_cell_is_over_when_its_ranks_said_so_not_when_they_exit():
    state = session(ranks=(0,))
    assert not state.over(BOTH)
    state.reported(0, CellEnded(1.0))
    assert state.over(BOTH) and state.result().outcome is Outcome.DONE


def test_a_failure_in_a_session_interrupts_the_ranks_still_in_the_cell_once():
    state = session(ranks=(0, 1, 2))
    state.reported(2, CellEnded(0.2))
    state.reported(1, failed(0.5))
    # Released from a collective it waited in, a rank says so in the moment it is given; then it is interrupted.
    assert state.tick(1.0, {0, 1, 2}) == [TakeStacks((0,), Why.STOP)]
    assert state.tick(1.0 + RELEASE_SECONDS, {0, 1, 2}) == [Signal(signal.SIGINT, (0,))]
    assert state.tick(3.0, {0, 1, 2}) == []
    state.reported(0, failed(1.5, "KeyboardInterrupt", interrupted=True))
    assert state.over({0, 1, 2})
    result = state.result()
    assert result.outcome is Outcome.FAILED
    error = render.error(result, {})
    assert isinstance(error, RankFailed)
    assert error.lines[-2:] == [
        "interrupted by taas after the failure: rank 0",
        "taas: the session goes on (%taas debug opens the debugger in rank 1 at the error)",
    ]


def test_a_session_reports_a_failure_before_an_interrupt_and_its_view_the_interrupt():
    for policy, reported in ((SESSION, Outcome.FAILED), (ONE_SHOT, Outcome.INTERRUPTED)):
        state = RunState(policy, 0.0, ranks=(0, 1))
        state.interrupt(1.0, BOTH)
        state.reported(0, failed(1.1, "KeyboardInterrupt", interrupted=True))
        state.reported(1, failed(1.2, "RuntimeError"))  # its peer left the collective
        result = state.result()
        assert (result.outcome, result.seen_as) == (reported, Outcome.INTERRUPTED)


def test_a_session_cell_raising_keyboardinterrupt_itself_lets_the_others_finish():
    state = session()
    state.reported(0, failed(0.5, "KeyboardInterrupt", interrupted=True))
    assert state.tick(1.0, BOTH) == []
    stopping = one_shot()
    stopping.reported(0, failed(0.5, "KeyboardInterrupt", interrupted=True))
    stopping.exited(0, 1, 0.5)
    assert stopping.tick(1.0, {1}) == [TakeStacks((1,), Why.STOP), Signal(signal.SIGTERM, (1,))]


def test_an_interrupted_session_cell_says_what_taas_interrupted():
    state = session()
    assert state.interrupt(1.0, BOTH) == [TakeStacks((0, 1), Why.STOP), Signal(STOP_TOGETHER, (0, 1))]
    for rank in (0, 1):
        state.reported(rank, failed(1.1, "KeyboardInterrupt", interrupted=True))
    error = render.error(state.result(), {})
    assert isinstance(error, RunInterrupted)
    assert error.lines == [
        f"{RED}{BOLD}KeyboardInterrupt{RESET}: taas interrupted the cell in ranks 0-1; the session goes on"
    ]


def test_a_session_cells_ranks_are_asked_to_stop_together_then_interrupted_where_they_are():
    state = session()
    state.interrupt(1.0, BOTH)
    assert state.tick(1.0 + STOP_SECONDS - 0.1, BOTH) == [], "the ranks have a moment to reach a step together"
    assert state.tick(1.0 + STOP_SECONDS, BOTH) == [Signal(signal.SIGINT, (0, 1))]
    state.reported(0, failed(3.1, "KeyboardInterrupt", interrupted=True))  # rank 1 does not leave
    assert state.tick(1.0 + STOP_SECONDS + 5.0, (1,)) == []
    assert state.tick(1.0 + STOP_SECONDS + 5.1, (1,)) == [TakeStacks((1,), Why.STUCK)], "5 s after the SIGINT"


def test_an_impatient_interrupt_while_the_ranks_stop_together_interrupts_them_where_they_are():
    state = session()
    state.interrupt(1.0, BOTH)
    assert state.interrupt(1.5, BOTH) == [Signal(signal.SIGINT, (0, 1))]
    assert state.tick(1.0 + STOP_SECONDS, BOTH) == [], "sent already"
    assert state.interrupt(2.0, BOTH) == [EndSession()], "a third, once every signal went, ends the session"


@pytest.mark.parametrize(
    "reports, said",
    [
        (
            {0: (596, False), 1: (596, False)},
            "taas: ranks 0-1 stopped after optimizer step 596 of this cell, each with the same steps applied",
        ),
        (
            {0: (596, False), 1: (595, False)},
            "rank 0 after optimizer step 596 of this cell; rank 1 after optimizer step 595 of this cell",
        ),
        ({0: (3, True), 1: (3, True)}, "ranks 0-1 inside optimizer step 4"),
        ({0: (None, False), 1: (7, False)}, "rank 0 before their first optimizer step; rank 1 after optimizer step 7"),
        ({0: (None, False), 1: (None, False)}, None),
    ],
)
def test_an_interrupted_session_cell_says_whether_its_ranks_stopped_at_the_same_optimizer_step(reports, said):
    state = session()
    state.interrupt(1.0, BOTH)
    for rank, (steps, inside) in reports.items():
        state.reported(
            rank, dataclasses.replace(failed(1.1, "KeyboardInterrupt", True), steps=steps, inside_step=inside)
        )
    lines = render.error(state.result(), {}).lines
    if said is None:
        assert len(lines) == 1, lines
    else:
        assert said in lines[1], lines
        agree = "each with the same steps applied" in lines[1]
        assert agree == ("different points" not in lines[1]) and ("may differ" in lines[1]) == (not agree)


def test_a_session_timeout_interrupts_the_late_ranks_and_the_session_goes_on():
    state = session(deadline=5.0, timeout=5.0)
    state.reported(0, CellEnded(4.0))
    asked = state.tick(5.0, BOTH)
    assert asked == [TakeStacks((1,), Why.LATE)]
    assert state.stacks_taken(asked[0], {}, 5.1, BOTH) == [Signal(STOP_TOGETHER, (1,))]
    state.reported(1, failed(5.2, "KeyboardInterrupt", interrupted=True))
    error = render.error(state.result(), {})
    assert isinstance(error, RunTimedOut)
    assert str(error) == "--timeout 5 s elapsed: rank 1 still running, now interrupted; the session goes on"
    assert error.lines[1:] == [f"{BOLD}before the time ran out: rank 0 had finished the cell{RESET}"]  # no stack came


def test_a_second_interrupt_while_the_ranks_leave_the_cell_ends_the_session():
    state = session()
    state.interrupt(1.0, BOTH)
    state.tick(1.0 + STOP_SECONDS, BOTH)  # the ranks are interrupted where they are: they leave the cell now
    assert state.interrupt(3.5, BOTH) == [EndSession()]
    result = state.result()
    assert result.outcome is Outcome.SESSION_ENDED and result.end is not None
    assert result.end.cause is EndCause.INTERRUPTED_TWICE
    error = render.error(result, {})
    assert isinstance(error, SessionEnded)
    assert str(error) == "taas: the session ended: interrupted twice while its ranks were leaving the cell"


def test_ranks_that_do_not_leave_an_interrupted_cell_in_5_s_end_the_session_with_where_they_were():
    state = session()
    state.reported(1, failed(0.5))
    assert state.tick(1.0, BOTH) == [TakeStacks((0,), Why.STOP)]
    assert state.tick(1.0 + RELEASE_SECONDS, BOTH) == [Signal(signal.SIGINT, (0,))]
    assert state.tick(6.5, BOTH) == []
    asked = state.tick(6.6, BOTH)
    assert asked == [TakeStacks((0,), Why.STUCK)]
    assert state.stacks_taken(asked[0], {0: dump(*ALL_REDUCE)}, 8.0, BOTH) == [EndSession()]
    error = render.session_ended(state.result(), {CELL: "Cell In[3]"})
    assert str(error) == (
        "rank 1 failed: ValueError: x; taas: the session ended: rank 0 did not leave the "
        "interrupted cell within 5 s (a collective waits for its peers there, or the code ignores "
        "interrupts)"
    )
    assert error.lines[3:] == [
        "stopped after the failure: rank 0",  # where it waited for the failure, once
        f"{BOLD}where they were when rank 1 failed:{RESET}",
        "rank 0: in all_reduce:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
        "    Cell In[3], line 4 in <module>",
        f"{RED}{BOLD}taas: the session ended: rank 0 did not leave the interrupted cell within "
        f"5 s (a collective waits for its peers there, or the code ignores interrupts){RESET}",
    ]


def test_a_rank_that_exits_ends_the_session_with_its_last_words():
    state = session()
    assert state.exited(1, -signal.SIGKILL, 1.0, ["Killed"]) == [EndSession()]
    error = render.session_ended(state.result(), {})
    assert str(error) == "taas: the session ended: rank 1 killed by signal SIGKILL: its process group cannot continue"
    assert error.lines[1:] == ["last lines it wrote to stderr:", "Killed"]
    exiting = session()
    exiting.reported(0, CellEnded(1.0, exited="sys.exit(0)"))
    exiting.reported(1, CellEnded(1.0))
    assert not exiting.over(BOTH)  # its exit, which ends the session, follows
    exiting.exited(0, 0, 1.1, ["ignored"])
    assert render.session_ended(exiting.result(), {}).lines == [
        f"{RED}{BOLD}taas: the session ended: rank 0 ended the session with sys.exit(0): its process group cannot "
        f"continue{RESET}"
    ]


def test_a_producer_that_dies_ends_the_session_one_that_finished_does_not():
    producer = Producer(0, 1)
    state = session(labels={producer: "producer 1 of train_loader"})
    assert state.exited(producer, 0, 1.0) == []
    assert state.exited(producer, -signal.SIGSEGV, 2.0, ["Segmentation fault"]) == [EndSession()]
    result = state.result()
    assert result.end is not None and result.end.cause is EndCause.PRODUCER_DIED
    error = render.session_ended(result, {})
    assert str(error) == "producer 1 of train_loader failed: killed by signal SIGSEGV; the session ended"
    assert error.lines[-1] == (
        f"{RED}{BOLD}taas: the session ended: producer 1 of train_loader cannot serve its loader any more{RESET}"
    )


def test_a_cell_sent_to_an_ended_session_says_why_it_ended():
    error = render.session_over("rank 1 exited between cells")
    assert (str(error), error.lines) == (
        "the session ended: rank 1 exited between cells",
        ["taas: the session ended: rank 1 exited between cells"],
    )
    assert render.exited_between_cells("rank 1", -signal.SIGKILL) == "rank 1 killed by signal SIGKILL between cells"


def test_a_stack_shown_after_a_timeout_stops_where_taas_handed_the_process_its_work() -> None:
    from taas_magic.delivery import producer
    from taas_magic.launch.supervisor import ranks
    from taas_magic.rank import cell, worker

    rank_dump = (
        f"Thread 0x1 (most recent call first):\n"
        f'  File "/tmp/ipykernel_1/3.py", line 2 in <module>\n'
        f'  File "{cell.__file__}", line 40 in run_cell\n'
        f'  File "{worker.__file__}", line 60 in run_rank\n'
    )
    assert stack_lines(rank_dump, {"/tmp/ipykernel_1/3.py": "Cell In[3]"}) == ["    Cell In[3], line 2 in <module>"]
    producer_dump = (
        f"Thread 0x2 (most recent call first):\n"
        f'  File "/data/loader.py", line 9 in __getitem__\n'
        f'  File "{producer.__file__}", line 150 in run\n'
        f'  File "{ranks.__file__}", line 80 in _run\n'
    )
    assert stack_lines(producer_dump, {}) == ['    File "/data/loader.py", line 9 in __getitem__'], (
        "taas's own frames left out"
    )


# -- the watchdog -------------------------------------------------------------------------------------
def stall(state: RunState, now: float, running=BOTH, stacks=None, watched=(0, 1)) -> Hang:
    """The watchdog speaks at ``now``: it asks for the stacks of ``watched``, and shows what it found."""
    [asked] = state.tick(now, running)
    assert asked == TakeStacks(watched, Why.HANG)
    [shown] = state.stacks_taken(asked, stacks or {}, now, running)
    assert isinstance(shown, ShowHang)
    return shown.hang


def test_the_watchdog_speaks_once_per_stall_after_hang_after_and_the_run_goes_on():
    state = one_shot(hang_after=10.0)
    state.reported(0, sample(0.0, seq=5, seconds=1.0), 0.0)
    assert state.tick(9.9, BOTH) == []
    asked = state.tick(10.0, BOTH)
    assert asked == [TakeStacks((0, 1), Why.HANG)]
    assert state.stacks_taken(asked[0], {0: dump(*ALL_REDUCE)}, 10.0, BOTH) == [
        ShowHang(
            Hang(
                10.0,
                (Process(0, "rank 0", sample(0.0, seq=5, seconds=1.0), 10.0, dump(*ALL_REDUCE)), Process(1, "rank 1")),
                10.0,
            )
        )
    ]
    assert state.tick(10.1, BOTH) == [] and state.tick(1000.0, BOTH) == []  # once per stall
    assert state.phase is Phase.RUNNING and state.stop is None


def test_the_hang_message_says_the_cause_where_each_rank_is_and_that_the_run_goes_on():
    state = one_shot(hang_after=10.0)
    state.reported(1, sample(0.0, seq=5, seconds=0.5), 0.0)
    state.reported(0, CellEnded(0.5), 0.5)
    state.exited(0, 0, 0.6)
    hang = stall(state, 10.5, {1}, {1: dump(*ALL_REDUCE)}, watched=(1,))
    assert [(p.key, p.ended) for p in hang.processes] == [(0, "had finished the cell"), (1, "")]  # 0 had left
    assert render.hang(hang, {CELL: "Cell In[2]"}) == [
        f"{RED}{BOLD}taas: no progress for 10 s: rank 0 has not entered all_reduce #5 that rank 1 waits in; "
        f"it had finished the cell{RESET}",
        "rank 0: had finished the cell",
        "rank 1: in all_reduce #5 (4 KB float32) for 11 s:",
        "    in all_reduce (torch/distributed/distributed_c10d.py, line 2501), called from:",
        "    Cell In[2], line 4 in <module>",
        f"{BOLD}taas: the run goes on: wait, or interrupt the cell to stop it (said after --hang-after 10 s without "
        f"progress; --hang-after 0 turns this off){RESET}",
    ]


@pytest.mark.parametrize(
    "progress",
    [
        lambda state: state.moved(15.0),  # a rank wrote output
        lambda state: state.reported(1, RankProgress(15.0, 3), 15.0),
        lambda state: state.reported(0, sample(15.0, finished=5), 15.0),  # left the collective: it finished
        lambda state: state.reported(1, sample(15.0, taken=1), 15.0),  # took an element
        lambda state: state.reported(1, sample(15.0, cpu=7.5), 15.0),  # half a core for 15 s: computing
    ],
    ids=["output", "taas.progress", "collective finished", "element taken", "computing"],
)
def test_progress_rearms_the_watchdog(progress):
    state = one_shot(hang_after=10.0)
    state.reported(0, sample(0.0, seq=5), 0.0)
    state.reported(1, sample(0.0), 0.0)
    stall(state, 10.0)
    progress(state)
    assert state.tick(24.9, BOTH) == []
    stall(state, 25.0)


@pytest.mark.parametrize(
    "still",
    [
        sample(5.0, seq=5, seconds=6.0),  # in the same collective, no CPU
        sample(5.0, cpu=5.0, seq=5, seconds=6.0),  # spinning in it
        sample(5.0, cpu=5.0, seq=5, seconds=6.0, waiting="train_loader"),
        sample(5.0, cpu=5.0, seq=5, seconds=6.0, setup=6.0),
        sample(5.0, cpu=0.1, seq=None),  # outside collectives, 2% of a core: a sleep with a timer, not work
    ],
    ids=["no cpu", "cpu in a collective", "cpu waiting for data", "cpu in setup", "little cpu"],
)
def test_a_rank_that_only_waits_is_no_progress(still):
    state = one_shot(hang_after=10.0)
    state.reported(0, dataclasses.replace(still, at=0.0, cpu=0.0), 0.0)
    state.reported(0, still, 5.0)
    assert state.tick(9.9, BOTH) == []
    stall(state, 10.0)


def test_time_at_a_debugger_prompt_is_no_stall():
    state = one_shot(hang_after=10.0)
    state.waited(30.0)  # a person answered a breakpoint() for 30 s
    assert state.tick(39.9, BOTH) == []
    stall(state, 40.0)


@pytest.mark.parametrize("hang_after", [0, 0.0, None])
def test_hang_after_0_turns_the_watchdog_off(hang_after):
    state = one_shot(hang_after=hang_after)
    assert state.tick(10_000.0, BOTH) == []


def test_no_watchdog_while_the_processes_are_stopped():
    state = one_shot(hang_after=10.0)
    state.interrupt(1.0, BOTH)
    actions = [action for now in (1.05, 4.0, 7.0, 50.0, 100.0) for action in state.tick(now, BOTH)]
    assert actions == [Signal(signal.SIGINT, (0, 1)), Signal(signal.SIGTERM, (0, 1)), Signal(signal.SIGKILL, (0, 1))]


def test_a_stall_seen_as_the_timeout_elapses_is_not_shown_as_a_run_that_goes_on():
    state = one_shot(deadline=10.0, timeout=10.0, hang_after=10.0)  # a cell stuck from its start
    shown = []
    for action in state.tick(10.0, BOTH):
        if isinstance(action, TakeStacks):
            shown += state.stacks_taken(action, {}, 10.1, BOTH)
    assert state.stop is not None and state.stop.cause is StopCause.TIMEOUT
    assert not [action for action in shown if isinstance(action, ShowHang)]


def test_a_session_cell_watches_its_own_ranks_and_the_producers():
    producer = Producer(0, 0)
    state = session(ranks=(0, 1), hang_after=10.0, labels={producer: "producer 0 of train_loader"})
    running = {0, 1, 2, 3, producer}  # ranks 2 and 3 are not in this cell
    assert state.tick(10.0, running) == [TakeStacks((0, 1, producer), Why.HANG)]
    state.reported(0, CellEnded(12.0), 12.0)  # its cell ended: progress, and no more its stall
    hang = stall(state, 22.0, running, watched=(1, producer))
    assert [(p.key, p.label, p.ended) for p in hang.processes] == [
        (0, "rank 0", "had finished the cell"),
        (1, "rank 1", ""),
        (producer, "producer 0 of train_loader", ""),
    ]


@settings(max_examples=30, deadline=None)
@given(behind=st.integers(0, 60), age=st.floats(0.0, 1.25))
def test_an_interrupt_says_where_the_ranks_were_when_their_stacks_were_taken(behind, age):
    """Samples come about once a second, each rank's at its own time; the stacks come with positions of their
    own moment (``records.position_line``): the diagnosis reads those, so ranks in lock step read as such, and a
    collective entered just then is not said to have lasted a second."""
    state = one_shot()
    for rank in (0, 1):  # older samples, far apart: what a fast loop gives
        state.reported(rank, sample(0.0, finished=1700 + rank * behind, seq=1701 + rank * behind), age)
    assert state.interrupt(1.3, BOTH) == [TakeStacks((0, 1), Why.STOP)]
    at_once = {
        0: RankActivity(1.3, 0.5, {"0": 1800}, []),
        1: RankActivity(1.3, 0.5, {"0": 1800}, [Collective("0", 1801, "all_reduce", [[1000]], ["Float"], 0.0004)]),
    }
    stacks = {rank: position_line(at_once[rank]).decode() + dump((CELL, 4, "<module>")) for rank in (0, 1)}
    state.stacks_taken(TakeStacks((0, 1), Why.STOP), stacks, 1.31, BOTH)
    for rank in (0, 1):
        state.reported(rank, failed(1.4, "KeyboardInterrupt", interrupted=True), 1.4)
        state.exited(rank, 130, 1.5)
    assert state.over(set())
    error = render.error(state.result(), {CELL: "Cell In[2]"})
    assert isinstance(error, RunInterrupted)
    where = [line for line in error.lines if line.startswith("rank")]
    assert where == ["ranks 0-1: rank 0 finished #1800, in no collective; rank 1 in all_reduce #1801 (4 KB float32):"]
    assert all(stack_line.startswith("    ") for stack_line in error.lines[error.lines.index(where[0]) + 1 :])


def test_a_session_timeout_says_whether_its_ranks_stopped_at_the_same_optimizer_step():
    state = session(deadline=5.0, timeout=5.0)
    asked = state.tick(5.0, BOTH)
    assert state.stacks_taken(asked[0], {}, 5.1, BOTH) == [Signal(STOP_TOGETHER, (0, 1))]
    for rank in (0, 1):
        state.reported(rank, dataclasses.replace(failed(5.3, "KeyboardInterrupt", True), steps=41))
    error = render.error(state.result(), {})
    assert isinstance(error, RunTimedOut)
    assert (
        error.lines[1]
        == "taas: ranks 0-1 stopped after optimizer step 41 of this cell, each with the same steps applied"
    )
