"""How a rank ends a cell that failed (rank/cell.py), without a process: what it says, and when."""

from __future__ import annotations

import dataclasses
from typing import Any

from taas_magic.rank.cell import _delivery_summaries, release_termination, run_cell
from taas_magic.wire.records import DeliverySummary, Failed
from taas_magic.wire.task import CellOrder, LoaderPlan, RankTask

SOURCE = """
def all_reduce():
    raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")

def step():
    all_reduce()

step()
"""


@dataclasses.dataclass
class SlowShell:
    """A shell whose IPython formatting is noted as it happens (in a rank it can take seconds)."""

    events: list[str]

    @property
    def InteractiveTB(self) -> Any:
        return self

    def structured_traceback(self, etype: type, error: BaseException, tb: Any) -> list[str]:
        self.events.append("formatted")
        return ["IPython's rendering"]


def _run(source: str, events: list[str], early: list[Failed], keep: bool = True) -> Failed:
    # keep: a session's task, so that the test's own process holds no SIGTERM (a one-shot rank holds it)
    task = RankTask(CellOrder(compile(source, "<cell>", "exec")), device="cpu", threads=1, keep=keep, track=False)

    def report_early(record: Failed) -> None:
        events.append("early")
        early.append(record)

    status, record, _, error = run_cell(task.order, {}, SlowShell(events), task, (), report_early)
    assert status != 0 and error is not None and isinstance(record, Failed)
    return record


def test_a_session_rank_a_peers_loss_broke_says_where_it_was_at_once_and_is_not_formatted_by_ipython() -> None:
    """Nobody reads a released rank's traceback (the cell shows where it was), and IPython's formatting of torch's
    collectives can outlast the 5 s the kernel gives a session's rank to leave its cell: Python's own it is."""
    events: list[str] = []
    early: list[Failed] = []
    record = _run(SOURCE, events, early)
    assert events == ["early"]
    (first,) = early
    assert first.peer_lost and record.peer_lost
    assert "in all_reduce" in first.stack and "in step" in first.stack and first.stack == record.stack
    assert (first.time, first.ename, first.evalue) == (record.time, record.ename, record.evalue)
    plain = "".join(first.traceback)
    assert "Connection closed by peer" in plain and 'File "<cell>"' in plain and "run_cell" not in plain
    assert record.traceback == first.traceback


def test_a_one_shot_rank_a_peers_loss_broke_says_where_it_was_before_its_traceback_is_formatted() -> None:
    events: list[str] = []
    early: list[Failed] = []
    try:
        record = _run(SOURCE, events, early, keep=False)
    finally:
        release_termination()  # the SIGTERM a one-shot rank holds until its failure is reported
    assert events == ["early", "formatted"]
    (first,) = early
    assert first.peer_lost and record.peer_lost and record.traceback == ["IPython's rendering"]


def test_a_failure_of_its_own_is_reported_once_whole() -> None:
    events: list[str] = []
    early: list[Failed] = []
    record = _run("raise ValueError('bad value 1')", events, early)
    assert events == ["formatted"] and early == []
    assert not record.peer_lost and record.stack == "" and record.evalue == "bad value 1"


LIGHTNING_SHUTDOWN = """
import sys
try:
    raise KeyboardInterrupt
except KeyboardInterrupt:
    sys.exit(1)  # as PyTorch Lightning's trainer ends a fit it was interrupted in, after its graceful shutdown
"""


def test_an_exit_that_ends_an_interrupt_is_the_interrupt_and_any_other_exit_a_failure() -> None:
    record = _run(LIGHTNING_SHUTDOWN, [], [])
    assert record.interrupted and record.ename == "KeyboardInterrupt"
    record = _run("import sys\nsys.exit(2)", [], [])
    assert not record.interrupted and record.evalue == "the cell called sys.exit(2)"


class SummingStandIn:
    """A stand-in's summary, as ``StandIn.summary`` gives it: what it took since it was last asked."""

    def __init__(self, taken: int) -> None:
        self.taken = taken

    def summary(self) -> DeliverySummary | None:
        taken, self.taken = self.taken, 0
        return DeliverySummary(taken, 0.0, 0.0, 1.0) if taken else None


def test_a_name_served_twice_rebound_to_another_loader_is_summed_up_once() -> None:
    """A session serves ``late``, then the notebook binds the name to another registered loader: the rank serves
    both plans under one name, and the cell's summary is the stand-in's, not lost to a second reading."""

    def plan(name: str, seed: int) -> LoaderPlan:
        return LoaderPlan(name, producers=1, units=None, prefetch=None, fastest=False, seed=seed)

    namespace: dict[str, Any] = {"late": SummingStandIn(8), "other": object()}
    summaries = _delivery_summaries((plan("late", 1), plan("other", 2), plan("late", 3)), namespace)
    assert summaries == {"late": DeliverySummary(8, 0.0, 0.0, 1.0)}
