"""A run in the background's handle, without ranks: what it answers while the run goes on and after, when its
names are bound (once, between cells or in a wait), stops taken by the run as interrupts, and the refusals."""

from __future__ import annotations

import argparse
import math
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.running.background import (
    BackgroundRun,
    BackgroundRuns,
    Errands,
    PullRequests,
    StopRequests,
    refuse,
)

RESULT = object()  # what the run's work returns: the handle hands it to take_back and never looks inside


def started(runs: BackgroundRuns, work, bound: list) -> BackgroundRun:
    run = runs.new("In[7]", "2 ranks on cpu")

    def take_back(result):
        assert result is RESULT and threading.current_thread() is threading.main_thread()
        bound.append(result)
        return {"losses": [1.0, 0.5], "model": "weights"}

    run.start(work, take_back)
    return run


def until_stopped(run_stops: list[StopRequests]):
    """A run's work that goes on until a stop is asked, as the pump takes one."""

    def work():
        while not run_stops[0].take():
            time.sleep(0.01)
        raise KeyboardInterrupt("taas run interrupted")

    return work


def test_a_finished_run_binds_its_names_once_in_a_wait_and_answers_after(capsys):
    runs, bound, go = BackgroundRuns(), [], threading.Event()
    run = started(runs, lambda: go.wait(10) and RESULT, bound)
    assert not run.done() and run.wait(0.05) is False
    assert run.state() == "run 1 (cell In[7], 2 ranks on cpu): running for 0 s"
    with pytest.raises(TaasUsageError, match="^taas run 1 is still running: .wait"):
        run.result  # noqa: B018
    go.set()
    assert run.wait() is True and run.wait() is True and len(bound) == 1
    assert run.result == {"losses": [1.0, 0.5], "model": "weights"} and len(bound) == 1
    assert run.state().endswith("; losses, model back in the notebook")
    runs.between_cells()
    assert capsys.readouterr().err == f"taas: {run.state()}\n" and runs.runs == []
    runs.between_cells()
    assert capsys.readouterr().err == "", "said once"


def test_names_come_back_between_cells_when_nobody_waited(capsys):
    runs, bound = BackgroundRuns(), []
    run = started(runs, lambda: RESULT, bound)
    run.join(5)
    assert bound == [], "not while a cell may run"
    runs.between_cells()
    assert bound == [RESULT] and "losses, model back in the notebook" in capsys.readouterr().err


def test_a_stop_is_taken_as_an_interrupt_and_a_stopped_run_says_so(capsys):
    runs, stops = BackgroundRuns(), []
    run = runs.new("In[3]", "4 ranks on cpu")
    stops.append(run.stops)
    run.start(until_stopped(stops), lambda result: {})
    assert runs.describe() == "taas: run 1 (cell In[3], 4 ranks on cpu): running for 0 s"
    assert runs.stop_all() == [run] and run.done() and runs.runs == []
    assert run.state().startswith("run 1 (cell In[3], 4 ranks on cpu): stopped after ")
    with pytest.raises(KeyboardInterrupt):
        run.result  # noqa: B018
    assert "KeyboardInterrupt: taas run interrupted" in capsys.readouterr().err, "shown in the run's own cell"
    assert runs.describe() == "taas: no run in the background (a taas cell with --background starts one)"


def test_a_failed_run_raises_its_error_on_result_and_says_it_in_one_line():
    runs = BackgroundRuns()

    def work():
        raise ValueError("rank 1 gave up\nand said more")

    run = started(runs, work, [])
    run.wait(5)
    with pytest.raises(ValueError, match="rank 1 gave up"):
        run.result  # noqa: B018
    assert run.state().endswith(": ValueError: and said more") and "\n" not in run.state()


def test_each_stop_asked_is_taken_once():
    stops = StopRequests()
    assert not stops.take()
    stops.ask()
    stops.ask()
    assert [stops.take(), stops.take(), stops.take()] == [True, True, False] and stops.asked_ever


@given(st.none() | st.integers() | st.floats() | st.text(max_size=5) | st.booleans())
def test_a_wait_takes_seconds_at_least_0_or_none_and_refuses_anything_else_naming_it(timeout):
    run = BackgroundRun(1, "In[1]", "1 rank on cpu")
    run._ended.set()  # an ended run: a wait that is allowed returns at once
    allowed = timeout is None or (
        isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and not math.isnan(timeout) and timeout >= 0
    )
    if allowed or isinstance(timeout, bool):  # a bool is an int to Python: wait(True) waits a second
        assert run.wait(timeout) is True
    else:
        with pytest.raises(TaasUsageError) as refused:
            run.wait(timeout)
        assert str(refused.value) == f"wait(timeout={timeout!r}) is not allowed: use a number of seconds >= 0, or None"


def options(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"keep": False, "ranks": None, "debug": False, "start": None, **given})


@pytest.mark.parametrize(
    ("given", "refusal"),
    [
        ({"keep": True}, "--background runs a one-shot cell, or a cell in a running session: start the session"),
        ({"debug": True}, "--debug keeps a failing rank paused for %taas debug"),
        ({"start": "fork"}, "--background starts its ranks from the fork server"),
    ],
)
def test_what_a_run_in_the_background_cannot_honour_is_refused_in_one_line(given, refusal):
    with pytest.raises(TaasUsageError) as refused:
        refuse(options(**given))
    assert str(refused.value).startswith(refusal) and "\n" not in str(refused.value)


@pytest.mark.parametrize("start", [None, "auto", "forkserver"])
def test_a_one_shot_cell_or_a_session_cell_may_run_in_the_background(start):
    refuse(options(start=start))
    refuse(options(start=start, ranks=(0,)))


def test_pulls_go_to_the_ranks_one_at_a_time_and_settle_when_every_rank_answered():
    pulls = PullRequests()
    first, second = pulls.ask(("losses",), (0, 1)), pulls.ask(("model",), (0,))
    assert pulls.take() == (first.number, ("losses",), (0, 1)) and pulls.take() is None, "one in flight at a time"
    pulls.answered(first.number, 0, b"zero")
    pulls.answered(first.number, "producer", b"?")  # producers send no names
    assert not first.settled.is_set()
    pulls.answered(first.number, 1, b"one")
    assert first.settled.is_set() and first.answers == {0: b"zero", 1: b"one"}
    assert pulls.take() == (second.number, ("model",), (0,))
    pulls.refused(second.number)
    assert second.settled.is_set() and second.answers == {}


def test_pulls_are_numbered_across_the_kernel_so_a_later_cell_never_reuses_a_number():
    """The ranks agree on the step that answers a pull under its number, in the session's store: a second background
    cell of the session numbering from 1 again would find the first cell's agreement there."""
    earlier, later = PullRequests(), PullRequests()
    first, second = earlier.ask(("x",), (0,)), later.ask(("x",), (0,))
    assert second.number > first.number


def test_pulls_asked_as_the_cell_ends_settle_with_what_came():
    pulls = PullRequests()
    asked, queued = pulls.ask(("x",), (0, 1)), pulls.ask(("y",), (0, 1))
    pulls.take()
    pulls.answered(asked.number, 0, b"zero")
    pulls.end()
    assert asked.settled.is_set() and asked.answers == {0: b"zero"} and queued.settled.is_set()
    late = pulls.ask(("z",), (0,))
    assert late.settled.is_set() and pulls.take() is None, "after the end nothing is asked"


def test_an_errand_is_done_by_the_pump_over_its_group_and_its_value_or_error_reaches_the_notebook():
    errands = Errands()
    asked, failing = errands.ask(lambda group: f"stacks of {group}"), errands.ask(lambda group: 1 / 0)
    errands.take().run("the group")  # the pump, in the run's thread
    assert asked.wait() is True and asked.value == "stacks of the group"
    errands.take().run("the group")
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    assert errands.take() is None


def test_errands_the_run_could_not_do_settle_undone_when_it_ends():
    errands = Errands()
    queued = errands.ask(lambda group: "never")
    errands.end()
    late = errands.ask(lambda group: "never")
    assert queued.wait() is False and late.wait() is False and errands.take() is None
