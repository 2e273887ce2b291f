"""`%taas resize N` on a training session, in a real kernel: ranks leave or join, the names and the DDP model stay."""

from __future__ import annotations

import re

import pytest
from support.kernel import Kernel
from test_kernel_sessions import DDP, DYING, REPLICAS, START, TRAIN, gone, pids, stop

MOSTLY_WAITS = True  # for ranks to start, join and end (tests/conftest.py)

# One write per line: a print of several values writes each apart, and another rank's output that comes between two
# of them, on a busy machine, leaves the line in two pieces.
SIZES_NOW = """print('pid ' + str(os.getpid()), flush=True)
print('world %d %s %s' % (dist.get_world_size(), os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE']), flush=True)
"""
SIZES = "#pragma taas\n" + SIZES_NOW


def trains_with_equal_replicas(kernel: Kernel, world: int) -> None:
    """DDP trains in every rank (stopped together by an interrupt), and the replicas hold the same parameters."""
    trained = kernel.execute(TRAIN, interrupt_after=0.5, counted_from="training", timeout=60)
    everyone = "rank 0" if world == 1 else f"ranks 0-{world - 1}"
    assert f"{everyone} stopped after optimizer step" in trained.traceback, trained.traceback
    replicas = kernel.execute(REPLICAS).ok()
    assert replicas.each_rank().count("replicas 1") == world, replicas.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_resize_to_two_then_to_four_keeps_training_the_same_ddp_model_with_equal_replicas(kernel, start):
    first = pids(kernel.execute(START.format(start=start).replace("--gpus 2", "--gpus 4") + DDP + SIZES_NOW).ok())
    try:
        trains_with_equal_replicas(kernel, 4)
        smaller = kernel.execute("%taas resize 2").ok()
        assert re.search(r"taas: the session has 2 ranks now: ranks 2-3 ended \(\d+\.\d s\)", smaller.stdout), smaller
        assert gone([first[2], first[3]], 5), "the ranks that left are gone"
        sizes = kernel.execute(SIZES).ok()
        assert pids(sizes) == {0: first[0], 1: first[1]}, "the same processes go on"
        assert sizes.each_rank().count("world 2 2 2") == 2, sizes.each_rank()
        trains_with_equal_replicas(kernel, 2)

        larger = kernel.execute("%taas resize 4").ok()
        assert "taas: the session has 4 ranks now: ranks 2-3 joined (" in larger.stdout, larger.stdout
        for rank in (2, 3):
            joined = rf"\[rank {rank}\] taas: rank {rank} is a new rank of the session: \d+ names"
            assert re.search(joined, larger.stderr), larger.stderr
        sizes = kernel.execute(SIZES).ok()
        now = pids(sizes)
        assert (now[0], now[1]) == (first[0], first[1]) and {now[2], now[3]} & {first[2], first[3]} == set()
        assert sizes.each_rank().count("world 4 4 4") == 4, sizes.each_rank()
        trains_with_equal_replicas(kernel, 4)
        assert "session:             up: 4 ranks on cpu" in kernel.execute("%taas").ok().stdout
    finally:
        stop(kernel)
    assert gone(now.values(), 5)  # and the fixture checks that nothing else is left


@pytest.mark.timeout(300)
def test_a_session_resized_to_one_rank_grows_again_and_heals_a_new_rank_that_dies(kernel):
    """Down to one rank (a group of one), up to three (rank 0 the only giver, and saying so), an interrupt while
    the new ranks join (the resize finishes first), then a new rank killed in training: replaced as any other."""
    kernel.execute(START.format(start="fork") + DDP + "shard = torch.full((2,), float(mine))\n").ok()
    try:
        assert "the session has 1 rank now: rank 1 ended" in kernel.execute("%taas resize 1").ok().stdout
        trains_with_equal_replicas(kernel, 1)
        larger = kernel.execute("%taas resize 3", interrupt_after=0.3)
        assert larger.error is None, larger.traceback
        assert "taas: the session has 3 ranks now: ranks 1-2 joined" in larger.stdout, larger.stdout
        assert "it waited until they had" in larger.stderr or larger.seconds < 0.3, larger.stderr
        assert "taas: rank 0 is the only other rank" in larger.stderr, larger.stderr
        sizes = kernel.execute(SIZES + "print('shard', shard.tolist(), flush=True)\n").ok()
        assert sizes.each_rank().count("world 3 3 3") == 3, sizes.each_rank()
        assert sizes.each_rank().count("shard [0.0, 0.0]") == 3, "rank 0's own shard: nothing told it apart"
        before = pids(sizes)
        died = kernel.execute(DYING.format(rank=2, step=5, how="os.kill(os.getpid(), signal.SIGKILL)"), timeout=60)
        assert died.error["evalue"] == "rank 2 failed: killed by signal SIGKILL", died.traceback
        assert "taas: the session goes on, a new process in place of rank 2" in died.traceback, died.traceback
        after = pids(kernel.execute(SIZES).ok())
        assert after[2] != before[2] and (after[0], after[1]) == (before[0], before[1])
        trains_with_equal_replicas(kernel, 3)
    finally:
        stop(kernel)
