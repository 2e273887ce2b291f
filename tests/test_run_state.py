"""The run state machine, driven by synthetic events and a synthetic clock: no process, no group, no kernel.

What it decides (signals, stacks, prompts, the end of a session), the result it hands back, and the
words ``render`` makes of that result, for one-shot cells and session cells alike.
"""

from __future__ import annotations

import dataclasses
import signal

import pytest

from taas_magic.errors import RankFailed, RunInterrupted, RunTimedOut, SessionEnded
from taas_magic.kernel import render
from taas_magic.kernel.run_state import (
    ONE_SHOT,
    SESSION,
    Answer,
    EndCause,
    EndSession,
    MarkEnded,
    Outcome,
    Phase,
    Prompt,
    RunState,
    ShowView,
    Signal,
    StopCause,
    TakeStacks,
)
from taas_magic.wire.events import Producer
from taas_magic.wire.records import CellEnded, DeliverySummary, Failed, SavedOnNode, SaveSkipped

RED, BOLD, RESET = "\x1b[0;31m", "\x1b[1m", "\x1b[0m"
BOTH = {0, 1}


def failed(when: float, name: str = "ValueError", interrupted: bool = False) -> Failed:
    return Failed(when, name, "x", [f"tb at {when}"], interrupted=interrupted)


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
    state.result_sent(b"names")
    assert state.tick(1.0, set()) == []
    assert state.over(set()) and state.phase is Phase.OVER
    result = state.result()
    assert (result.outcome, result.results, result.failures) == (Outcome.DONE, b"names", ())
    assert render.error(result, {}) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.outcome = Outcome.FAILED  # type: ignore[misc]


def test_a_failure_stops_the_others_with_sigterm_then_sigkill_3_s_later():
    state = one_shot()
    state.reported(1, failed(0.5))
    assert state.exited(1, 1, 0.6) == [MarkEnded(1, "failed")]
    assert state.tick(1.0, {0}) == [Signal(signal.SIGTERM, (0,))]
    assert state.phase is Phase.STOPPING and state.stop is not None and state.stop.cause is StopCause.FAILURE
    assert state.tick(3.9, {0}) == []
    assert state.tick(4.0, {0}) == [Signal(signal.SIGKILL, (0,))]
    assert state.exited(0, -signal.SIGKILL, 4.1) == [MarkEnded(0, "stopped")]
    assert state.tick(10.0, set()) == [] and state.over(set())
    result = state.result()
    assert result.outcome is Outcome.FAILED and [f.rank for f in result.failures] == [1]
    error = render.error(result, {})
    assert isinstance(error, RankFailed) and str(error) == "rank 1 failed: ValueError: x"
    assert error.lines == [f"{RED}{BOLD}taas: rank 1 failed: ValueError: x{RESET}",
                           f"{BOLD}rank 1's traceback:{RESET}", "tb at 0.5",
                           "stopped by taas after the failure: rank 0"]


def test_an_interrupt_escalates_and_another_skips_to_the_next_signal():
    state = RunState(ONE_SHOT, 100.0)
    assert state.interrupt(100.0, BOTH) == []  # the first signal goes with the next tick
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
    assert state.tick(1.0, {0}) == [Signal(signal.SIGTERM, (0,))]
    assert state.interrupt(1.5, {0}) == []
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
    assert error.lines == [f"{RED}{BOLD}KeyboardInterrupt{RESET}: taas run interrupted; every rank stopped "
                           "(0: had finished, 1: KeyboardInterrupt)"]


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
    assert lines[-1] == ("also failed, after producer 0 of train_loader: rank 1 (RuntimeError: x); "
                         "rank 0 (killed by signal SIGSEGV)")
    crash = dataclasses.replace(result, failures=result.failures[2:])
    assert render.failure(crash, "stopped")[1][1:3] == [f"{BOLD}last lines rank 0 wrote to stderr:{RESET}",
                                                        "Segmentation fault"]


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


def test_a_timeout_takes_the_late_ranks_stacks_and_stops_them():
    state = one_shot(deadline=10.0, timeout=10.0)
    assert state.tick(9.9, BOTH) == []
    state.reported(0, CellEnded(9.95))  # rank 0 sends its names back: not late
    asked = state.tick(10.0, BOTH)
    assert asked == [TakeStacks((1,), late=True)]
    stack = 'Thread 0x1 (most recent call first):\n  File "/tmp/ipykernel_1/2.py", line 3 in <module>'
    assert state.stacks_taken(asked[0], {1: stack}, 10.5, BOTH) == [Signal(signal.SIGTERM, (0, 1))]
    result = state.result()
    assert result.outcome is Outcome.TIMED_OUT and result.late == {1: stack}
    error = render.error(result, {"/tmp/ipykernel_1/2.py": "Cell In[2]"})
    assert isinstance(error, RunTimedOut)
    assert str(error) == "--timeout 10 s elapsed: rank 1 still running, now stopped"
    assert error.lines == [f"{RED}{BOLD}taas: --timeout 10 s elapsed: rank 1 still running, now stopped{RESET}",
                           f"{BOLD}before the time ran out: rank 0 had finished the cell{RESET}",
                           f"{BOLD}rank 1 was here when the time ran out:{RESET}",
                           "Thread 0x1 (most recent call first):", "  Cell In[2], line 3 in <module>"]


def test_a_rank_that_ended_its_cell_while_its_stack_was_taken_is_not_late():
    state = one_shot(deadline=10.0, timeout=10.0)
    asked = state.tick(10.0, BOTH)
    assert asked == [TakeStacks((0, 1), late=True)]
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
    assert state.input_requested(0, "(Pdb) ") == [Prompt(0, "(Pdb) ")]
    state.waited(30.0)
    assert state.deadline == 40.0 and state.tick(39.0, BOTH) == []


def test_a_prompt_while_stopping_is_answered_quit_and_its_rank_counts_as_stopped():
    state = one_shot()
    state.reported(1, failed(0.5))
    assert state.input_requested(0, "(Pdb) ") == [Prompt(0, "(Pdb) ")]  # a one-shot rank failed once it exited
    state.exited(1, 1, 0.6)
    assert state.input_requested(0, "(Pdb) ") == [Answer(0, "quit")]
    assert 0 in state.stopped


def test_quitting_a_debugger_interrupts_the_run_and_is_no_failure_to_restart():
    state = one_shot()
    state.reported(0, Failed(1.0, "BdbQuit", ""))
    assert state.tick(1.0, BOTH) == [Signal(signal.SIGINT, (0, 1))]
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
    assert state.tick(1.0, BOTH) == [Signal(signal.SIGTERM, (0,))]
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
        "time (first element after 10 ms)"]
    session_cell = session()
    session_cell.reported(1, SaveSkipped("model.pt"))
    session_cell.reported(0, CellEnded(1.0, delivery=delivery))
    assert [line.split(":")[1] for line in render.notices(session_cell.result())] == [" train_loader"]


def test_a_restart_is_announced_with_the_one_line_failure():
    state = one_shot()
    state.reported(1, failed(0.5))
    state.exited(1, 1, 0.5)
    assert render.restarting(state.result(), 1, 2) == \
        "taas: rank 1 failed: ValueError: x: every rank starts again (restart 1 of --max-restarts 2)\n"


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
    assert state.tick(1.0, {0, 1, 2}) == [Signal(signal.SIGINT, (0,))]
    assert state.tick(3.0, {0, 1, 2}) == []
    state.reported(0, failed(1.5, "KeyboardInterrupt", interrupted=True))
    assert state.over({0, 1, 2})
    result = state.result()
    assert result.outcome is Outcome.FAILED
    error = render.error(result, {})
    assert isinstance(error, RankFailed)
    assert error.lines[-2:] == ["interrupted by taas after the failure: rank 0",
                                "taas: the session goes on (%taas debug opens the debugger in rank 1 at the error)"]


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
    assert stopping.tick(1.0, {1}) == [Signal(signal.SIGTERM, (1,))]


def test_an_interrupted_session_cell_says_what_taas_interrupted():
    state = session()
    assert state.interrupt(1.0, BOTH) == [Signal(signal.SIGINT, (0, 1))]
    for rank in (0, 1):
        state.reported(rank, failed(1.1, "KeyboardInterrupt", interrupted=True))
    error = render.error(state.result(), {})
    assert isinstance(error, RunInterrupted)
    assert error.lines == [f"{RED}{BOLD}KeyboardInterrupt{RESET}: taas interrupted the cell in ranks 0, 1; "
                           "the session goes on"]


def test_a_session_timeout_interrupts_the_late_ranks_and_the_session_goes_on():
    state = session(deadline=5.0, timeout=5.0)
    state.reported(0, CellEnded(4.0))
    asked = state.tick(5.0, BOTH)
    assert asked == [TakeStacks((1,), late=True)]
    assert state.stacks_taken(asked[0], {}, 5.1, BOTH) == [Signal(signal.SIGINT, (1,))]
    state.reported(1, failed(5.2, "KeyboardInterrupt", interrupted=True))
    error = render.error(state.result(), {})
    assert isinstance(error, RunTimedOut)
    assert str(error) == "--timeout 5 s elapsed: rank 1 still running, now interrupted; the session goes on"
    assert error.lines[-1] == "(no stack received)"


def test_a_second_interrupt_while_the_ranks_leave_the_cell_ends_the_session():
    state = session()
    state.interrupt(1.0, BOTH)
    assert state.interrupt(1.5, BOTH) == [EndSession()]
    result = state.result()
    assert result.outcome is Outcome.SESSION_ENDED and result.end is not None
    assert result.end.cause is EndCause.INTERRUPTED_TWICE
    error = render.error(result, {})
    assert isinstance(error, SessionEnded)
    assert str(error) == "taas: the session ended: interrupted twice while its ranks were leaving the cell"


def test_ranks_that_do_not_leave_an_interrupted_cell_in_5_s_end_the_session_with_where_they_were():
    state = session()
    state.reported(1, failed(0.5))
    assert state.tick(1.0, BOTH) == [Signal(signal.SIGINT, (0,))]
    assert state.tick(6.0, BOTH) == []
    asked = state.tick(6.1, BOTH)
    assert asked == [TakeStacks((0,), late=False)]
    assert state.stacks_taken(asked[0], {0: "Thread 0x1:\n  File \"x.py\", line 1 in f"}, 8.0, BOTH) == [EndSession()]
    error = render.session_ended(state.result(), {})
    assert str(error) == ("rank 1 failed: ValueError: x; taas: the session ended: rank 0 did not leave the "
                          "interrupted cell within 5 s (a collective waits for its peers there, or the code ignores "
                          "interrupts)")
    assert "stopped by taas after the failure: rank 0" in error.lines
    assert error.lines[-3:] == [f"{BOLD}rank 0 was here:{RESET}", "Thread 0x1:", '  File "x.py", line 1 in f']


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
        f"continue{RESET}"]


def test_a_producer_that_dies_ends_the_session_one_that_finished_does_not():
    producer = Producer(0, 1)
    state = session(labels={producer: "producer 1 of train_loader"})
    assert state.exited(producer, 0, 1.0) == []
    assert state.exited(producer, -signal.SIGSEGV, 2.0, ["Segmentation fault"]) == [EndSession()]
    result = state.result()
    assert result.end is not None and result.end.cause is EndCause.PRODUCER_DIED
    error = render.session_ended(result, {})
    assert str(error) == "producer 1 of train_loader failed: killed by signal SIGSEGV; the session ended"
    assert error.lines[-1] == (f"{RED}{BOLD}taas: the session ended: producer 1 of train_loader cannot serve its "
                               f"loader any more{RESET}")


def test_a_cell_sent_to_an_ended_session_says_why_it_ended():
    error = render.session_over("rank 1 exited between cells")
    assert (str(error), error.lines) == ("the session ended: rank 1 exited between cells",
                                         ["taas: the session ended: rank 1 exited between cells"])
    assert render.exited_between_cells("rank 1", -signal.SIGKILL) == "rank 1 killed by signal SIGKILL between cells"


def test_a_stack_shown_after_a_timeout_stops_where_taas_handed_the_process_its_work() -> None:
    from taas_magic.delivery import producer
    from taas_magic.launch.supervisor import ranks
    from taas_magic.rank import cell, worker

    rank_dump = (f'Thread 0x1 (most recent call first):\n'
                 f'  File "/tmp/ipykernel_1/3.py", line 2 in <module>\n'
                 f'  File "{cell.__file__}", line 40 in run_cell\n'
                 f'  File "{worker.__file__}", line 60 in run_rank\n')
    assert render.user_stack(rank_dump, {"/tmp/ipykernel_1/3.py": "Cell In[3]"}) == [
        "Thread 0x1 (most recent call first):", "  Cell In[3], line 2 in <module>"]
    producer_dump = (f'Thread 0x2 (most recent call first):\n'
                     f'  File "/data/loader.py", line 9 in __getitem__\n'
                     f'  File "{producer.__file__}", line 150 in run\n'
                     f'  File "{ranks.__file__}", line 80 in _run\n')
    assert render.user_stack(producer_dump, {}) == [
        "Thread 0x2 (most recent call first):", '  File "/data/loader.py", line 9 in __getitem__',
        f'  File "{producer.__file__}", line 150 in run']
