"""A `%taas pull` while a session's cell trains (``rank/stopping.py``, ``rank/pulling.py``): two real DDP ranks
(gloo, the run's store served here), asked at random moments and a little apart, answer before the same optimizer
step with equal replicas, and train on; a cell that steps no optimizer answers at once."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist

from taas_magic.rank.stopping import StepStops
from taas_magic.wire.rank_control import PULL_KEY, PULL_TOGETHER, STOP_TOGETHER

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


def _ranks(train: bool):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe() for _ in range(2)]
    processes = [
        context.Process(target=_rank, args=(rank, store.port, pipes[rank][1], train), daemon=True) for rank in (0, 1)
    ]
    for process in processes:
        process.start()
    conns = [ours for ours, _ in pipes]
    for conn in conns:
        assert conn.poll(60) and conn.recv() == "ready", "a rank did not get ready"
    return store, processes, conns


def _pull(store, processes, conns, number: int, skew: float) -> list:
    store.set(PULL_KEY, json.dumps({"number": number, "names": ["model"], "ranks": [0, 1]}))
    os.kill(processes[0].pid, PULL_TOGETHER)
    time.sleep(skew)  # the supervisor signals one rank after the other
    os.kill(processes[1].pid, PULL_TOGETHER)
    answers = []
    for conn in conns:
        assert conn.poll(30), "a rank did not answer"
        answers.append(conn.recv())
    return answers


def _kill(processes) -> None:
    """Whatever happened: nothing of the test is left among this process's children (reaped)."""
    for process in processes:
        process.kill()
        process.join(10)


def _end(processes, conns) -> None:
    for process in processes:
        os.kill(process.pid, STOP_TOGETHER)
    for conn in conns:
        assert conn.poll(30) and conn.recv() == "stopped"
    for process in processes:
        process.join(10)


@pytest.mark.timeout(180)
def test_ranks_pulled_at_random_moments_answer_before_the_same_step_with_equal_replicas_and_train_on():
    store, processes, conns = _ranks(train=True)
    rng = random.Random(5)
    try:
        seen = -1
        for number in range(1, ROUNDS + 1):
            time.sleep(rng.uniform(0.05, 0.5))
            (n0, names0, step0, total0), (n1, names1, step1, total1) = _pull(
                store, processes, conns, number, rng.choice((0.0, 0.001, 0.01, 0.1))
            )
            assert n0 == n1 == number and names0 == names1 == ("model",)
            assert step0 == step1 > seen, "the same step in both ranks, later each time: they train on"
            assert total0 == total1, "the replicas are equal"
            seen = step0
        _end(processes, conns)
    finally:
        _kill(processes)
        del store


@pytest.mark.timeout(120)
def test_a_cell_that_steps_no_optimizer_answers_at_once():
    store, processes, conns = _ranks(train=False)
    try:
        started = time.monotonic()
        answers = _pull(store, processes, conns, 1, 0.0)
        assert [step for _, _, step, _ in answers] == [0, 0] and time.monotonic() - started < 10
        _end(processes, conns)
    finally:
        _kill(processes)
        del store


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
