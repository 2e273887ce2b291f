"""What a loader's row in the live view says: elements taken, skipped by ranks that stopped early, ready, finished."""

from __future__ import annotations

import torch

from taas_magic.delivery import transport
from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import StreamPlan
from taas_magic.delivery.standin import StandIn
from taas_magic.kernel.run.run_result import ONE_SHOT
from taas_magic.kernel.run.run_state import RunState
from taas_magic.kernel.running.controller import Pump
from taas_magic.kernel.view.front_end import CellFrontEnd
from taas_magic.kernel.view.live_view import RunView
from taas_magic.kernel.view.streams import RankOutput
from taas_magic.wire.events import Report
from taas_magic.wire.records import DeliveryProgress


def stats(produced=0, taken=(0, 0), skipped=(0, 0), buffered=0, done=(0, 0), at=1.0, waited=()) -> DeliveryProgress:
    return DeliveryProgress("steps", at, produced, list(taken), list(skipped), buffered, list(done), list(waited))


def row(*reports: DeliveryProgress) -> str:
    view = RunView("2 ranks on cpu", range(2))
    for report in reports:
        view.take(-1, report)
    return view.loaders["steps"].text()


def test_the_row_names_what_was_taken_skipped_buffered_and_which_ranks_finished():
    assert row(stats(20, (5, 5), buffered=10)) == "20 produced · 10 consumed (5, 5 per rank) · 10 ready"
    assert row(stats(17, (3, 3), (7, 7), 8)) == "17 produced · 6 consumed (3, 3 per rank) · 14 skipped · 8 ready"
    assert (
        row(stats(20, (10, 3), (0, 7), 0, (0, 1)))
        == "20 produced · 13 consumed (10, 3 per rank) · 7 skipped · 0 ready · rank 1 finished"
    )


def test_the_row_shows_the_rate_and_how_long_ranks_waited():
    assert (
        row(stats(0, at=1.0), stats(200, (100, 100), waited=(0.5, 1.5), at=3.0))
        == "200 produced · 100/s · 200 consumed (100, 100 per rank) · 0 ready · ranks waited 50%"
    )


def test_the_view_shows_the_loader_in_its_text_and_its_html():
    view = RunView("2 ranks on cpu", range(2))
    view.take(-1, stats(20, (5, 5), buffered=10))
    shown = view.render(1.0)
    assert any(line.startswith("steps") and line.endswith("10 ready") for line in shown["text/plain"].splitlines())
    assert 'data-key="loader-steps"' in shown["text/html"]


def test_an_older_report_arriving_late_does_not_replace_a_newer_one():
    view = RunView("2 ranks on cpu", range(2))
    group = _OneBatch(
        [Report(-1, stats(20, (10, 3), at=2.0)), Report(0, stats(12, (5, 3), at=1.0))]
    )  # a producer's look, read before the rank's
    write = lambda stream, text: None  # noqa: E731
    front = CellFrontEnd(write, status=lambda bundle, final: None)
    Pump(group, RunState(ONE_SHOT, 0.0), RankOutput(write, prefix=False), front, view).until_over()
    assert view.loaders["steps"].latest.produced == 20


class _OneBatch:
    """A group whose only process reports ``batch`` and is gone."""

    def __init__(self, batch):
        self.batch = batch

    def events(self, timeout):
        batch, self.batch = self.batch, []
        return batch

    def running(self):
        return {0} if self.batch else set()


def test_a_rank_that_leaves_a_pass_and_then_finishes_is_counted_exactly():
    plan = StreamPlan(pass_length=8, world=1, units=None)
    counters = Counters(producers=1, ranks=1)
    producers_end, ranks_end = transport.channel_pair()
    try:
        for index in range(6):  # a producer ahead of the rank by 6 elements of pass 0
            transport.send(producers_end, 0, index, torch.tensor([index]))
            counters.count_sent(0, 0)
        stand_in = StandIn("steps", None, 0, plan, ranks_end, counters, fastest=False, device="cpu")
        for number, batch in enumerate(stand_in):
            if number == 2:
                break
        now = counters.stats("steps")
        assert (now.taken, now.skipped, now.buffered) == ([3], [5], 0), "the 3 sent but not taken are dropped"
        for index in range(2):  # the start of pass 1
            transport.send(producers_end, 1, index, torch.tensor([index]))
            counters.count_sent(0, 0)
        assert counters.stats("steps").buffered == 2
        reported = []
        stand_in.finish(reported.append)
        assert (reported[0].buffered, reported[0].done) == (0, [1])
        assert not counters.wants(0, 1), "producers send a finished rank nothing more"
    finally:
        producers_end.close()
        ranks_end.close()
