"""A session rank's process-group connections (``rank/group_links.py``), with real DDP ranks on gloo: the rank
that fails cuts them and its peers leave their collective at once; every rank connects the same group anew, and the
same DDP models train on together. A rank held in a collective when interrupted cuts its own (``rank/release.py``)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.forked_ranks import forked_ranks

from taas_magic.rank import run_store
from taas_magic.rank.group_links import GroupLinks
from taas_magic.rank.release import GRACE_SECONDS, Release

WORLD = 3


def _rank(rank: int, port: int, conn, failing: int, at_step: int, after_backward: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    run_store._client.clear()  # this process's own client, not one its parent made
    links = GroupLinks()
    links.install()
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    applied = 0
    try:
        for step in range(10_000):
            if rank == failing and step == at_step and not after_backward:
                raise ValueError("bad batch")
            model(torch.randn(8, 16)).square().mean().backward()
            if rank == failing and step == at_step:
                raise ValueError("bad batch")
            optimizer.step()
            optimizer.zero_grad()
            applied += 1
    except Exception as e:
        left = time.monotonic()
        cut = links.cut()
        conn.send((left, applied, type(e).__name__, str(e)[:200], cut))
    assert conn.recv() == "regroup"
    links.regroup(1)
    optimizer.zero_grad()
    for _ in range(3):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    total = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))], dtype=torch.float64)
    every = [torch.zeros_like(total) for _ in range(WORLD)]
    dist.all_gather(every, total)
    conn.send([float(t) for t in every])
    links.uninstall()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(failing=st.integers(0, WORLD - 1), at_step=st.integers(0, 6), after_backward=st.booleans())
def test_a_failing_rank_releases_its_peers_at_once_and_the_group_trains_on(failing, at_step, after_backward):
    with forked_ranks(_rank, WORLD, failing, at_step, after_backward) as ranks:
        answered = [conn.poll(60) for conn in ranks.conns]
        assert all(answered), f"ranks that left their cell: {answered}"
        left = [conn.recv() for conn in ranks.conns]
        first = min(moment for moment, *_ in left)
        assert max(moment for moment, *_ in left) - first < 5, "every rank left within moments of the failure"
        assert left[failing][2:4] == ("ValueError", "bad batch")
        assert all(cut for *_, cut in left), "each rank says its group needs connecting anew"
        for peer in set(range(WORLD)) - {failing}:
            assert left[peer][2] == "RuntimeError" and "onnection" in left[peer][3], left[peer]
        steps = [applied for _, applied, *_ in left]
        assert steps[failing] == at_step
        # Raised before its backward: the others wait for it in that backward, with the same steps applied. After
        # it: they applied that step and wait in the next backward.
        assert all(steps[peer] == at_step + after_backward for peer in set(range(WORLD)) - {failing}), steps
        for conn in ranks.conns:
            conn.send("regroup")
        for conn in ranks.conns:
            assert conn.poll(60), "the group was connected again and trains"
        totals = [conn.recv() for conn in ranks.conns]
        assert all(seen == totals[0] for seen in totals)
        assert (len(set(totals[0])) == 1) is not after_backward, "equal replicas unless a step came between"


def _held(rank: int, port: int, conn, in_collective: bool) -> None:
    """Rank 0 waits in a barrier that rank 1 never joins (or sleeps in Python), armed for its interrupt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    links = GroupLinks()
    links.install()
    release = Release(links)
    release.install()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank, world_size=2)
    if rank == 0:
        with release.armed():
            conn.send("waiting")
            try:
                if in_collective:
                    dist.barrier()
                else:
                    time.sleep(60)
            except KeyboardInterrupt:
                conn.send(time.monotonic())
        time.sleep(GRACE_SECONDS + 0.5)  # a cut would come by now
    assert conn.recv() == "together"
    total = torch.ones(1)
    try:
        dist.all_reduce(total)
        conn.send(float(total))
    except RuntimeError as e:
        conn.send(str(e)[:100])
    links.uninstall()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_collective", [True, False], ids=["in a barrier", "in Python"])
def test_an_interrupted_rank_held_in_a_collective_is_released_by_its_own_thread_and_only_then(in_collective):
    with forked_ranks(_held, 2, in_collective) as ranks:
        ours = ranks.conns
        assert ours[0].poll(30) and ours[0].recv() == "waiting"
        time.sleep(0.3)  # into the barrier
        interrupted = time.monotonic()
        os.kill(ranks.processes[0].pid, signal.SIGINT)
        assert ours[0].poll(10), "rank 0 stayed in its barrier"
        left = ours[0].recv() - interrupted
        if in_collective:
            assert GRACE_SECONDS <= left < GRACE_SECONDS + 3, left
        else:
            assert left < GRACE_SECONDS, left  # the interrupt came at once: nothing was cut
        for conn in ours:
            conn.send("together")
        after = [conn.recv() if conn.poll(30) else "no answer" for conn in ours]
        if in_collective:  # its connections are cut: the next collective fails (a session reconnects it first)
            assert all(isinstance(said, str) for said in after), after
        else:
            assert after == [2.0, 2.0], after
