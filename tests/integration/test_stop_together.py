"""A session cell's interrupt taken at the same optimizer step in every rank (``rank/stopping.py``): two real DDP
ranks (gloo, the run's store served here) interrupted at random moments keep equal replicas, each time."""

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
from taas_magic.wire.rank_control import STOP_TOGETHER

ROUNDS = 6


def _rank(rank: int, port: int, conn, train: bool, optimizers: int = 1) -> None:
    """A session's rank in miniature: cells that train a DDP model until interrupted, each reporting its steps and
    parameters. Two optimizers: a GAN's two models in turn, each its own DDP."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)
    models = [torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16)) for _ in range(optimizers)]
    pairs = [(model, torch.optim.SGD(model.parameters(), lr=0.01)) for model in models]
    steps = StepStops()
    steps.install()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for cell in range(1, ROUNDS + 1):
        conn.send("ready")
        conn.recv()
        try:
            with steps.running(cell):
                while True:
                    if not train:
                        time.sleep(0.01)
                        continue
                    for model, optimizer in pairs:
                        model(torch.randn(8, 16)).square().mean().backward()
                        optimizer.step()
                        optimizer.zero_grad()
        except KeyboardInterrupt:
            total = sum(float(p.detach().double().sum()) for model in models for p in model.parameters())
            conn.send((steps.progress(), total))
    dist.destroy_process_group()


def _interrupt(ranks: Ranks, after: float, skew: float) -> list:
    processes, conns = ranks.processes, ranks.conns
    for conn in conns:
        assert conn.poll(60), "a rank did not get ready"
        assert conn.recv() == "ready"
    for conn in conns:
        conn.send("go")
    time.sleep(after)
    os.kill(processes[0].pid, STOP_TOGETHER)
    time.sleep(skew)  # the supervisor signals one rank after the other
    os.kill(processes[1].pid, STOP_TOGETHER)
    answers = []
    for conn in conns:
        assert conn.poll(30), "a rank did not stop"
        answers.append(conn.recv())
    return answers


@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizers", [1, 2])
def test_ranks_interrupted_at_random_moments_stop_after_the_same_step_with_equal_replicas(optimizers):
    rng = random.Random(11)
    with forked_ranks(_rank, 2, True, optimizers) as ranks:
        for _ in range(ROUNDS):
            (progress0, total0), (progress1, total1) = _interrupt(
                ranks, rng.uniform(0.05, 0.6), rng.choice((0.0, 0.001, 0.01, 0.1))
            )
            assert progress0 is not None and progress0 == progress1, (progress0, progress1)
            assert progress0[1] is False, "stopped between steps, not inside one"
            assert total0 == total1, "the replicas are equal"


@pytest.mark.timeout(120)
def test_a_cell_that_steps_no_optimizer_is_interrupted_at_once():
    with forked_ranks(_rank, 2, False) as ranks:
        for _ in range(2):
            started = time.monotonic()
            answers = _interrupt(ranks, 0.1, 0.0)
            assert [progress for progress, _ in answers] == [None, None]
            assert time.monotonic() - started < 10


def test_a_stop_between_cells_stands_for_an_interrupt_which_is_dropped_there():
    steps = StepStops()
    steps.install()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.kill(os.getpid(), STOP_TOGETHER)  # between cells: an interrupt, ignored as taas ignores it there
        time.sleep(0.05)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt), steps.running(1):
            os.kill(os.getpid(), STOP_TOGETHER)  # in a cell that began no step: at once
            time.sleep(5)
        assert steps.progress() is None
    finally:
        steps.uninstall()
        signal.signal(signal.SIGINT, before)
