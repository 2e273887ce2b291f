"""A `%taas pull` while a session's cell trains (``rank/stopping.py``, ``rank/pulling.py``): two real DDP ranks
(gloo, the run's store served here), asked at random moments and a little apart, answer before the same optimizer
step with equal replicas, and train on; a cell that steps no optimizer answers at once."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist
from support.forked_ranks import Ranks, forked_ranks

from taas_magic.rank.stopping import StepStops
from taas_magic.wire.rank_control import PULL_KEY, PULL_TOGETHER, STOP_TOGETHER, pull_request

ROUNDS = 6


def _rank(rank: int, port: int, conn, train: bool) -> None:
    """A session's rank in miniature: one cell that trains a DDP model until interrupted; each pull it answers says
    how many steps it had begun and what its parameters sum to."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = StepStops()

    def answer(asked) -> None:
        total = sum(float(p.detach().double().sum()) for p in model.parameters())
        conn.send((asked.number, asked.names, steps.begun - (1 if steps.begun else 0), total))

    steps.answer_pull = answer
    steps.install()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with steps.running(1):
            conn.send("ready")  # in the cell: a pull before it would be one between cells, ignored
            while True:
                if not train:
                    time.sleep(0.01)
                    continue
                model(torch.randn(8, 16)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    except KeyboardInterrupt:
        conn.send("stopped")
    dist.destroy_process_group()


def _ready(ranks: Ranks) -> None:
    for conn in ranks.conns:
        assert conn.poll(60) and conn.recv() == "ready", "a rank did not get ready"


def _pull(ranks: Ranks, number: int, skew: float, early: float = 0.0) -> list:
    """Put pull ``number`` in the store and tell both ranks, ``skew`` apart; with ``early``, rank 1 is told that long
    before the request is put (a rank on another node than node 0, which puts it)."""
    if early:
        os.kill(ranks.processes[1].pid, PULL_TOGETHER)
        time.sleep(early)
    ranks.store.set(PULL_KEY, pull_request(number, ("model",), (0, 1)))
    os.kill(ranks.processes[0].pid, PULL_TOGETHER)
    time.sleep(skew)  # the supervisor signals one rank after the other
    if not early:
        os.kill(ranks.processes[1].pid, PULL_TOGETHER)
    answers = []
    for conn in ranks.conns:
        assert conn.poll(30), "a rank did not answer"
        answers.append(conn.recv())
    return answers


def _end(ranks: Ranks) -> None:
    for process in ranks.processes:
        os.kill(process.pid, STOP_TOGETHER)
    for conn in ranks.conns:
        assert conn.poll(30) and conn.recv() == "stopped"
    for process in ranks.processes:
        process.join(10)


@pytest.mark.timeout(180)
def test_ranks_pulled_at_random_moments_answer_before_the_same_step_with_equal_replicas_and_train_on():
    rng = random.Random(5)
    with forked_ranks(_rank, 2, True) as ranks:
        _ready(ranks)
        seen = -1
        for number in range(1, ROUNDS + 1):
            time.sleep(rng.uniform(0.05, 0.5))
            (n0, names0, step0, total0), (n1, names1, step1, total1) = _pull(
                ranks, number, rng.choice((0.0, 0.001, 0.01, 0.1))
            )
            assert n0 == n1 == number and names0 == names1 == ("model",)
            assert step0 == step1 > seen, "the same step in both ranks, later each time: they train on"
            assert total0 == total1, "the replicas are equal"
            seen = step0
        _end(ranks)


@pytest.mark.timeout(180)
def test_a_rank_told_before_the_request_is_in_the_store_answers_that_request_not_the_one_before():
    """On a cluster, node 0's supervisor puts the request while the other nodes' ranks may be told already: they read
    the request numbered after the last they read, not the previous one still in the store."""
    with forked_ranks(_rank, 2, True) as ranks:
        _ready(ranks)
        seen = -1
        for number, early in ((1, 0.0), (2, 0.3), (3, 0.05)):
            time.sleep(0.2)
            (n0, _, step0, total0), (n1, _, step1, total1) = _pull(ranks, number, 0.0, early)
            assert n0 == n1 == number, f"rank 1 answered pull {n1}, rank 0 pull {n0}; asked {number}"
            assert step0 == step1 >= seen and total0 == total1
            seen = step0
        _end(ranks)


@pytest.mark.timeout(120)
def test_a_cell_that_steps_no_optimizer_answers_at_once():
    with forked_ranks(_rank, 2, False) as ranks:
        _ready(ranks)
        started = time.monotonic()
        answers = _pull(ranks, 1, 0.0)
        assert [step for _, _, step, _ in answers] == [0, 0] and time.monotonic() - started < 10
        _end(ranks)


def test_a_pull_between_cells_is_ignored():
    steps = StepStops()
    answered = []
    steps.answer_pull = answered.append
    steps.install()
    try:
        os.kill(os.getpid(), PULL_TOGETHER)
        time.sleep(0.05)
        assert answered == []
    finally:
        steps.uninstall()
