"""The controller's pump, driven by a scripted group of ranks: output, outcome, root cause, closing.

The decisions themselves are the run state machine's, tested without any group in test_run_state.py."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.specs import cpu_spec

from taas_magic.errors import RankFailed, RunInterrupted, RunLost
from taas_magic.kernel.running import controller
from taas_magic.kernel.view.front_end import CellFrontEnd
from taas_magic.wire.events import Exited, Output, Producer, Report
from taas_magic.wire.records import CellEnded, Failed


class ScriptedGroup:
    """Plays back batches of events; records the signals the controller sends."""

    def __init__(self, batches: list[list], on_signal=None):
        self.batches = list(batches)
        self.alive = {0, 1}
        self.signals: list[int] = []
        self.on_signal = on_signal or (lambda group, signum: None)
        self.closed = False

    def events(self, timeout):
        batch = self.batches.pop(0) if self.batches else []
        for event in batch:
            if isinstance(event, Exited):
                self.alive.discard(event.rank)
        return batch

    def running(self):
        return set(self.alive)

    def signal(self, signum, ranks=None):
        self.signals.append(signum)
        self.on_signal(self, signum)

    def stacks(self, ranks, timeout):
        return {rank: f"stack of {rank}" for rank in ranks}

    def nodes(self):
        return frozenset()

    def close(self):
        self.closed = True


class ScriptedBackend:
    name = "scripted"

    def __init__(self, group):
        self.group = group

    def start(self, plan, launch):
        assert sorted(launch.envs) == [0, 1]
        return self.group


def run(group, **kwargs):
    written = []
    front = CellFrontEnd(lambda s, t: written.append((s, t)))
    controller.run(cpu_spec(**kwargs), None, ScriptedBackend(group), front, {})
    return written


def error(rank: int, when: float, name: str) -> Report:
    return Report(rank, Failed(when, name, "x", [f"tb {rank}"]))


def test_success_streams_output_and_closes_the_group():
    group = ScriptedGroup(
        [
            [Output(0, "stdout", b"hi\n"), Output(1, "stdout", b"there\n")],
            [Report(0, CellEnded(0.0)), Exited(0, 0)],
            [Report(1, CellEnded(0.0)), Exited(1, 0)],
        ]
    )
    assert run(group) == [("stdout", "[rank 0] hi\n"), ("stdout", "[rank 1] there\n")]
    assert group.closed and group.signals == []


def test_the_earliest_failure_is_the_root_cause_even_if_reported_later():
    def stop(group, signum):
        group.batches.append([Exited(r, -signum) for r in sorted(group.alive)])

    group = ScriptedGroup([[error(1, 20.0, "RuntimeError"), Exited(1, 1)], [error(0, 10.0, "ValueError")]], stop)
    with pytest.raises(RankFailed) as caught:
        run(group)
    assert str(caught.value) == "rank 0 failed: ValueError: x"
    assert "also failed, after rank 0: rank 1 (RuntimeError: x)" in "\n".join(caught.value.lines)
    assert group.signals[0] == signal.SIGTERM and group.closed


def test_a_rank_stopped_by_taas_is_not_reported_as_a_failure():
    def stop(group, signum):
        group.batches.append([Exited(0, -signum)])

    group = ScriptedGroup([[Exited(1, -signal.SIGSEGV)]], stop)
    with pytest.raises(RankFailed) as caught:
        run(group)
    assert str(caught.value) == "rank 1 failed: killed by signal SIGSEGV"
    assert "stopped after the failure: rank 0" in caught.value.lines


def test_a_rank_that_exited_0_mid_cell_is_named_before_the_failure_it_caused():
    # os._exit(0) in rank 1: no record, status 0. Rank 0's collective then fails; its failure's own
    # time (10.0) is earlier than when taas saw rank 1's exit, but taas saw that exit first.
    group = ScriptedGroup([[Exited(1, 0)], [error(0, 10.0, "RuntimeError"), Exited(0, 1)]])
    with pytest.raises(RankFailed) as caught:
        run(group)
    assert str(caught.value) == "rank 0 failed: RuntimeError: x"
    assert "before rank 0 failed: rank 1 exited with code 0 before the cell finished" in "\n".join(caught.value.lines)


def test_a_rank_that_finished_its_cell_or_was_stopped_by_taas_is_not_said_to_have_exited_early():
    finished = ScriptedGroup([[Report(0, CellEnded(5.0)), Exited(0, 0)], [error(1, 10.0, "ValueError"), Exited(1, 1)]])
    with pytest.raises(RankFailed) as caught:
        run(finished)
    lines = "\n".join(caught.value.lines)
    assert "before rank 1 failed: rank 0 had finished the cell" in lines and "exited with code 0" not in lines

    def stop(group, signum):  # rank 0 leaves on taas's SIGTERM with status 0, without a record
        group.batches.append([Exited(0, 0)])

    stopped = ScriptedGroup([[error(1, 10.0, "ValueError"), Exited(1, 1)]], stop)
    with pytest.raises(RankFailed) as caught:
        run(stopped)
    lines = "\n".join(caught.value.lines)
    assert "before rank 1 failed" not in lines and "stopped after the failure: rank 0" in lines


def test_a_producer_stopped_once_every_rank_is_done_never_fails_the_cell():
    def stop(group, signum):  # its DataLoader's worker dies of the stop first: the producer reports an error
        group.batches.append([error(Producer(0, 0), 30.0, "RuntimeError"), Exited(Producer(0, 0), 1)])

    group = ScriptedGroup([[Report(0, CellEnded(0.0)), Exited(0, 0), Report(1, CellEnded(0.0)), Exited(1, 0)]], stop)
    group.alive = {0, 1, Producer(0, 0)}
    run(group)
    assert group.signals[0] == signal.SIGTERM and group.closed


class LosingGroup(ScriptedGroup):
    """Its supervisor goes after one batch: the backend says the run's processes are lost."""

    def events(self, timeout):
        if not self.batches:
            raise RunLost("node 127.0.0.3 (node 1 of the run) was lost: its agent died")
        return super().events(timeout)


def test_a_lost_runs_view_ends_as_lost_with_no_rank_still_running():
    group = LosingGroup([[Output(0, "stdout", b"hi\n")]])
    shown: list[tuple[dict, bool]] = []
    with pytest.raises(RunLost):
        front = CellFrontEnd(lambda s, t: None, status=lambda b, f: shown.append((b, f)))
        controller.run(cpu_spec(), None, ScriptedBackend(group), front, {})
    summary, final = shown[-1]
    assert final and summary["text/plain"].startswith("taas: 2 ranks on cpu · lost after "), summary
    assert "running" not in summary["text/plain"] and group.closed


class InterruptedGroup(ScriptedGroup):
    """Two ranks that run until interrupted; the user's interrupt lands in the pump's call number ``at`` of
    ``running()``, its test of whether the run is over among them; ``again``: a second one lands as the first
    is passed on to the ranks (a person who presses twice)."""

    def __init__(self, at: int, again: bool):
        super().__init__([[Output(0, "stdout", b"training\n")]] * 20, on_signal=_stop_on_interrupt)
        self.calls, self.at, self.again = 0, at, again

    def running(self):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return super().running()

    def signal(self, signum, ranks=None):
        super().signal(signum, ranks)
        if self.again:
            self.again = False
            raise KeyboardInterrupt


def _stop_on_interrupt(group, signum):
    if signum == signal.SIGINT and group.alive:
        group.batches.append([error(rank, 1.0, "KeyboardInterrupt") for rank in sorted(group.alive)])
        group.batches.append([Exited(rank, 1) for rank in sorted(group.alive)])


@settings(max_examples=30, deadline=None)
@given(at=st.integers(1, 12), again=st.booleans())
def test_an_interrupt_that_lands_anywhere_in_the_pump_is_the_cells_interrupt(at, again):
    group = InterruptedGroup(at, again)
    with pytest.raises(RunInterrupted):
        run(group)
    assert signal.SIGINT in group.signals and group.closed
