"""Twenty interrupts of a 4-rank DDP session's training in a row, each at a random moment: the session goes on
every time, the cell ends within 5 s of the interrupt, and the replicas are the same every time."""

from __future__ import annotations

import random
import statistics

import pytest
from test_kernel_sessions import DDP, REPLICAS, START, TRAIN, stop

MOSTLY_WAITS = True  # for the ranks to stop and the cells to end (tests/conftest.py)
INTERRUPTS = 20


@pytest.mark.timeout(420)
def test_twenty_interrupts_of_ddp_training_in_a_row_each_end_the_cell_within_five_seconds_with_equal_replicas(
    kernel,
):
    kernel.execute(START.format(start="fork").replace("--gpus 2", "--gpus 4") + DDP).ok()
    rng = random.Random(20)
    took = []
    try:
        for number in range(INTERRUPTS):
            after = rng.uniform(0.2, 2.0)
            r = kernel.execute(TRAIN, interrupt_after=after, counted_from="training", timeout=60)
            assert r.error is not None and r.error["ename"] == "RunInterrupted", (number, r.traceback)
            assert "ranks 0-3 stopped after optimizer step" in r.traceback, (number, r.traceback)
            training = next(arrived for _, text, arrived in r.streams if "training" in text)
            took.append(r.seconds - (training + after))
            assert took[-1] < 5, (number, took)
            replicas = kernel.execute(REPLICAS).ok()
            assert replicas.each_rank().count("replicas 1") == 4, (number, replicas.stdout)
        trained = kernel.execute(TRAIN, interrupt_after=0.5, counted_from="training", timeout=60)
        assert "each with the same steps applied" in trained.traceback, trained.traceback
    finally:
        stop(kernel)
    print(f"interrupt to the cell's end: median {statistics.median(took):.2f} s, max {max(took):.2f} s")
