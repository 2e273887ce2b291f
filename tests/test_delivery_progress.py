"""What the progress line says: elements taken, skipped by ranks that stopped early, buffered, finished."""

from __future__ import annotations

import torch

from taas_magic.backend import Report
from taas_magic.records import DeliveryProgress
from taas_magic.controller import _progress_line, _Watch
from taas_magic.delivery import transport
from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import StreamPlan
from taas_magic.delivery.standin import StandIn


def stats(produced=0, taken=(0, 0), skipped=(0, 0), buffered=0, done=(0, 0), at=1.0) -> DeliveryProgress:
    return DeliveryProgress("steps", at, produced, list(taken), list(skipped), buffered, list(done))


def test_the_line_names_what_was_taken_skipped_buffered_and_which_ranks_finished():
    assert _progress_line(stats(20, (5, 5), buffered=10)) == \
        "taas: steps: 20 produced, 10 consumed (5, 5 per rank), 10 buffered"
    assert _progress_line(stats(17, (3, 3), (7, 7), 8)) == \
        "taas: steps: 17 produced, 6 consumed (3, 3 per rank), 14 skipped, 8 buffered"
    assert _progress_line(stats(20, (10, 3), (0, 7), 0, (0, 1))) == \
        "taas: steps: 20 produced, 13 consumed (10, 3 per rank), 7 skipped, 0 buffered; rank 1 finished"


def test_an_older_report_arriving_late_does_not_replace_a_newer_one():
    shown = []
    watch = _Watch(None, None, {}, {}, shown.append, lambda stream, text: None, None)
    watch._handle(Report(-1, stats(20, (10, 3), at=2.0)))
    watch._handle(Report(0, stats(12, (5, 3), at=1.0)))  # a producer's look, read before the rank's
    assert shown == [["taas: steps: 20 produced, 13 consumed (10, 3 per rank), 0 buffered"]]


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
