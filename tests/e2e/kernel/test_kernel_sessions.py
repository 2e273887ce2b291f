"""Sessions (`--keep`): ranks that stay alive from cell to cell, in a real kernel, as a notebook runs them."""

from __future__ import annotations

import random
import re
import time

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kernel import Kernel, view_rows

MOSTLY_WAITS = True  # for ranks to end, sessions to stop, timeouts (tests/conftest.py)

# A pid is printed in one write: a print of several values writes each apart, and another rank's output that comes
# between two of them, on a busy machine, leaves the line in two pieces ("[rank 2] pid" and "[rank 2]  21905").
START = """#pragma taas --gpus 2 --keep --start {start}
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
mine = int(os.environ["RANK"])
run_id = os.environ["TAAS_RUN_ID"]
print("pid " + str(os.getpid()), flush=True)
"""


def pids(result) -> dict[int, int]:
    return {int(rank): int(pid) for rank, pid in re.findall(r"\[rank (\d)\] pid (\d+)", result.each_rank())}


def gone(pid_list, within: float) -> bool:
    deadline = time.monotonic() + within
    while any(psutil.pid_exists(pid) for pid in pid_list) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(psutil.pid_exists(pid) for pid in pid_list)


def assert_same_ranks_go_on(kernel: Kernel, first) -> None:
    """The next cell runs in the session's own processes, and their process group still works."""
    again = kernel.execute("#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)\ndist.barrier()").ok()
    assert pids(again) == pids(first)


def stop(kernel: Kernel) -> None:
    kernel.execute("%taas stop").ok()


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_session_keeps_its_ranks_their_names_and_their_process_group(kernel, start):
    first = kernel.execute(START.format(start=start)).ok()
    try:
        second = kernel.execute(
            "#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)\n"
            "t = torch.tensor([float(mine)])\ndist.all_reduce(t)\ntotal = t.item()"
        ).ok()
        assert pids(second) == pids(first) and len(pids(first)) == 2, "the same processes run every cell"
        assert kernel.value("total") == 1.0, "the process group made in the first cell is still there"
        assert kernel.value("mine") == 0, "rank 0's names come back after each cell"
        third = kernel.execute("#pragma taas\nprint('mine', mine)").ok()
        assert "[rank 1] mine 1" in third.each_rank(), "each rank keeps its own names: rank 0's are not sent to it"
        shown = kernel.execute("%taas").ok().stdout
        assert re.search(rf"session: +up: 2 ranks on cpu, started by {start}, 3 cells run, idle for \d+ s", shown), (
            shown
        )
    finally:
        stop(kernel)


def test_the_notebooks_names_go_to_the_ranks_again_only_when_they_changed(kernel):
    kernel.execute(START.format(start="fork")).ok()
    try:
        kernel.execute(
            "settings = {'lr': 0.1}\nweights = torch.zeros(3)\ndef scaled(x):\n    return x * settings['lr']"
        ).ok()
        kernel.execute("#pragma taas\nsettings['lr'] = 0.5 + mine\nweights += 1 + mine").ok()  # the ranks' own changes
        r = kernel.execute("#pragma taas\nprint('seen', scaled(1.0), weights.tolist())").ok()
        assert "[rank 1] seen 1.5 [2.0, 2.0, 2.0]" in r.each_rank(), (
            "unchanged names are not sent again: the ranks keep theirs"
        )
        assert kernel.value("weights.tolist()") == [1.0, 1.0, 1.0], "rank 0's weights came back"
        kernel.execute("settings['lr'] = 2.0\nweights.add_(10)").ok()  # changed in place in the notebook
        r = kernel.execute("#pragma taas\nprint('seen', scaled(1.0), weights.tolist())").ok()
        assert "[rank 1] seen 2.0 [11.0, 11.0, 11.0]" in r.each_rank(), r.each_rank()
        kernel.execute("def scaled(x):\n    return -x").ok()  # redefined: its new code goes
        assert "[rank 0] seen -1.0" in kernel.execute("#pragma taas\nprint('seen', scaled(1.0))").ok().each_rank()
    finally:
        stop(kernel)


def test_ranks_runs_a_cell_in_part_of_the_session_and_the_others_wait(kernel):
    kernel.execute(START.format(start="fork")).ok()
    try:
        r = kernel.execute("#pragma taas --ranks 1\nnote = 'only here'\nprint('ran')").ok()
        assert r.each_rank().strip() == "[rank 1] ran", "labels stay those of the whole session"
        r = kernel.execute("#pragma taas\nprint('note', globals().get('note'))").ok()
        assert "[rank 0] note None" in r.each_rank() and "[rank 1] note only here" in r.each_rank()
        assert kernel.execute("#pragma taas --ranks 0 --return none\nx = 1").ok().stdout == ""
        bad = kernel.execute("#pragma taas --ranks 0,2\nx = 1")
        assert bad.error["evalue"] == "--ranks 0,2: the session has ranks 0-1, not rank 2", bad.error
    finally:
        stop(kernel)


def test_an_exception_fails_the_cell_and_keeps_the_session(kernel):
    first = kernel.execute(START.format(start="fork")).ok()
    try:
        r = kernel.execute(
            "#pragma taas\nimport time\nif mine == 1:\n    raise ValueError('bad batch')\ntime.sleep(30)"
        )
        assert r.error["evalue"] == "rank 1 failed: ValueError: bad batch", r.error
        assert "Cell In[" in r.traceback and "interrupted by taas after the failure: rank 0" in r.traceback
        assert "the session goes on" in r.traceback and r.seconds < 10
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


def test_an_interrupt_stops_the_cell_in_every_rank_and_the_session_survives(kernel):
    first = kernel.execute(START.format(start="forkserver")).ok()
    try:
        r = kernel.execute(
            "#pragma taas\nimport time\ntry:\n    time.sleep(60)\nfinally:\n    print('cleaned', flush=True)",
            interrupt_after=2.0,
        )
        assert "KeyboardInterrupt" in r.traceback and "the session goes on" in r.traceback, r.traceback
        assert "[rank 0] cleaned" in r.each_rank() and "[rank 1] cleaned" in r.each_rank() and r.seconds < 6
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


DDP = """model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
"""
TRAIN = """#pragma taas
print("training", flush=True)
while True:
    model(torch.randn(16, 32)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
REPLICAS = """#pragma taas
total = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))], dtype=torch.float64)
every = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
dist.all_gather(every, total)
print("replicas", len({float(t) for t in every}), flush=True)
"""


@pytest.mark.timeout(300)  # interrupts of training, each followed by a look at the replicas
@pytest.mark.parametrize("start, interrupts", [("fork", 2), ("forkserver", 2)])  # 20 in a row: its own file
def test_interrupted_ddp_training_stops_every_rank_after_the_same_step_and_trains_on(kernel, start, interrupts):
    """An interrupt that landed wherever each rank was left DDP's replicas different (one more optimizer step in
    one rank than in another, or one stopped inside a step): the ranks now stop before the same step, say so, and
    the same DDP model trains on in the next cell. --timeout stops them the same way."""
    first = kernel.execute(START.format(start=start) + DDP).ok()
    rng = random.Random(5)
    try:
        timed_out = kernel.execute(TRAIN.replace("#pragma taas", "#pragma taas --timeout 1.5"), timeout=60)
        assert timed_out.error is not None and timed_out.error["ename"] == "RunTimedOut", timed_out.traceback
        assert "ranks 0-1 stopped after optimizer step" in timed_out.traceback, timed_out.traceback
        for _ in range(interrupts):
            r = kernel.execute(TRAIN, interrupt_after=rng.uniform(0.3, 1.5), counted_from="training", timeout=60)
            assert r.error is not None and r.error["ename"] == "RunInterrupted", r.traceback
            said = re.search(
                r"taas: ranks 0-1 stopped after optimizer step (\d+) of this cell, each with the same", r.traceback
            )
            assert said and int(said[1]) > 0, r.traceback
            replicas = kernel.execute(REPLICAS).ok()
            assert replicas.each_rank().count("replicas 1") == 2, replicas.stdout
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


SLOW_TO_UNPICKLE = """
import time
class Index:
    # rebuilds its table when unpickled, as many real objects do: a second in each rank
    def __init__(self, n):
        self.n = n
    def __getstate__(self):
        return {"n": self.n}
    def __setstate__(self, state):
        self.n = state["n"]
        time.sleep(1.0)
"""


@pytest.mark.parametrize("start", ["fork", "forkserver"])
@pytest.mark.timing
def test_an_interrupt_while_ranks_take_the_cell_in_stops_it_before_its_code(kernel, start):
    """The interrupt reaches the ranks while they unpack a name the notebook changed: it is held for
    the cell, whose code then does not start, and the session goes on (it was lost before)."""
    kernel.execute(SLOW_TO_UNPICKLE).ok()
    first = kernel.execute(START.format(start=start) + "count = 0").ok()
    try:
        for n, delay in enumerate((0.3, 0.6)):
            kernel.execute(f"index = Index({n})").ok()  # changed in the notebook: shipped with the next cell
            r = kernel.execute(
                "#pragma taas\nprint('started', index.n)\ntime.sleep(3)\ncount += 1", interrupt_after=delay, timeout=60
            )
            assert r.error is not None and r.error["ename"] == "RunInterrupted", (r.stdout, r.traceback)
            assert "started" not in r.stdout and r.seconds < 2.5, (r.stdout, r.seconds)
            assert "the session goes on" in r.traceback
        counts = kernel.execute("#pragma taas\nprint('count', count, index.n)").ok()
        assert counts.each_rank().count("count 0 1") == 2, counts.stdout
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


@pytest.mark.parametrize("options", ["--timeout 2", "--hang-after 2 --timeout 4"], ids=["timeout", "hang-after"])
def test_a_session_cell_that_times_out_releases_a_rank_waiting_for_another_and_the_session_goes_on(kernel, options):
    """taas, not the user, interrupted the cell: the error says the time ran out first and where each rank was; the
    rank interrupted in its sleep cuts its connections, so the one waiting for it in a barrier leaves it too; the
    process group works in the next cell. The live view becomes the summary."""
    first = kernel.execute(START.format(start="fork")).ok()
    try:
        cell = "if mine == 0:\n    dist.barrier()\nelse:\n    time.sleep(30)"
        r = kernel.execute(f"#pragma taas {options}\nimport time\n{cell}", timeout=60)
        timeout = options.split("--timeout ")[1].split()[0]
        assert r.error["ename"] == "RunTimedOut", r.traceback
        lines = r.traceback.splitlines()
        assert lines[0] == (
            f"taas: --timeout {timeout} s elapsed: ranks 0-1 still running, now interrupted; the session goes on"
        ), lines
        assert "rank 0: in barrier #1" in r.traceback and "time.sleep(30)" in r.traceback, r.traceback
        # stacks taken, reports formatted, the group connected anew: seconds more on a loaded machine
        assert "KeyboardInterrupt" not in r.traceback and r.seconds < float(timeout) + 15, r.traceback
        summary = r.displays[-1]["text/plain"].splitlines()
        assert re.fullmatch(r"taas: \d ranks? on cpu · timed out after [\d.]+ s", summary[0]), summary
        assert r.display_messages[-1][0] == "update_display_data" and "running" not in str(r.displays[-1])
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


def test_a_session_cell_that_times_out_in_a_collective_with_no_peer_in_the_cell_releases_it_and_goes_on(kernel):
    """Rank 0 waits in a barrier for rank 1, which is not in the cell: no interrupt reaches it in gloo's wait, so a
    thread of its own cuts its process group's connections a second after the interrupt came (rank/release.py),
    the barrier fails, the interrupt is raised, and the group is connected anew: the session goes on."""
    first = kernel.execute(START.format(start="fork")).ok()
    try:
        alone = "#pragma taas --timeout 2 --ranks 0\ndist.barrier()  # rank 1 is not in the cell"
        r = kernel.execute(alone, timeout=60)
        assert r.error["ename"] == "RunTimedOut", r.traceback
        assert r.error["evalue"] == (
            "--timeout 2 s elapsed: rank 0 still running, now interrupted; the session goes on"
        ), r.error
        assert "rank 0: in barrier #1" in r.traceback and "rank 1: is not in this cell (--ranks)" in r.traceback
        assert r.seconds < 2 + 15, r.seconds  # the stop at a step 2 s, SIGINT, the release 1 s: about 6 s here
        summary = r.displays[-1]["text/plain"].splitlines()
        assert re.fullmatch(r"taas: \d ranks? on cpu · timed out after [\d.]+ s", summary[0]), summary
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


def test_an_interrupt_of_ranks_in_mismatched_collectives_releases_them_all_and_the_session_goes_on(kernel):
    """Rank 0 in an all_reduce, rank 1 in a broadcast: each waits for the other for ever. Interrupted, each is
    released by its own thread, and the next cell's collectives work."""
    first = kernel.execute(START.format(start="fork")).ok()
    try:
        code = (
            "#pragma taas\nprint('in', flush=True)\nif mine == 0:\n    dist.all_reduce(torch.ones(3))\n"
            "else:\n    dist.broadcast(torch.ones(5), 0)"
        )
        r = kernel.execute(code, interrupt_after=1.0, counted_from="in", timeout=60)
        assert r.error["ename"] == "RunInterrupted", r.traceback
        assert "taas interrupted the cell in ranks 0-1; the session goes on" in r.traceback, r.traceback
        assert "rank 0: in all_reduce #" in r.traceback and "rank 1: in broadcast #" in r.traceback, r.traceback
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


def test_a_failure_while_the_others_wait_in_a_collective_releases_them_and_the_session_goes_on(kernel):
    """The failing rank cuts its process group's connections: the others leave the collective at once, every rank
    connects the group anew, and the next cell's collective works in the same processes."""
    first = kernel.execute(START.format(start="fork").replace("--gpus 2", "--gpus 3")).ok()
    try:
        r = kernel.execute(
            "#pragma taas\nif mine == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(torch.ones(1))", timeout=60
        )
        assert r.error["evalue"] == "rank 1 failed: ValueError: bad batch", r.error
        tb = r.traceback
        assert tb.count("where they were") == 1 and "the session goes on" in tb and r.seconds < 5, tb
        assert re.search(
            r"where they were when rank 1 failed:\nranks 0,2: .*in all_reduce.*:\n(.*\n)*"
            r"    Cell In\[\d+\], line 4 in <module>\n      dist.all_reduce\(torch.ones\(1\)\)\n",
            tb,
        ), tb
        rows = [line.split()[:3] for line in view_rows(r.displays[-1]["text/plain"])]
        assert rows[1] == ["rank", "1", "failed"], rows
        debugged = kernel.execute("%taas debug", answers=["p mine", "q"]).ok()
        assert debugged.prompts == ["[rank 1] (Pdb) "] * 2 and "[rank 1] 1" in debugged.each_rank(), debugged.stdout
        assert_same_ranks_go_on(kernel, first)
        total = kernel.execute("#pragma taas\nt = torch.ones(1)\ndist.all_reduce(t)\ntotal = t.item()").ok()
        assert kernel.value("total") == 3.0 and "[ranks 0-2]" not in total.stderr
    finally:
        stop(kernel)


FAILING = """#pragma taas
print("training", flush=True)
for step in range(1_000_000):
    if mine == {rank} and step == {step} and not {after_backward}:
        raise ValueError("bad batch")
    model(torch.randn(16, 32)).square().mean().backward()
    if mine == {rank} and step == {step}:
        raise ValueError("bad batch")
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.mark.timeout(240)
def test_a_rank_raising_mid_training_keeps_the_session_and_ddp_trains_on_with_equal_replicas(kernel):
    """A rank that raises while the others wait for it in DDP's all_reduce: they are released, the cell fails with
    its traceback, the session goes on, and the same DDP models train on. Raised between backward() and step(),
    after the others had passed that point: the cell says the replicas may differ."""
    first = kernel.execute(START.format(start="fork").replace("--gpus 2", "--gpus 4") + DDP).ok()
    try:
        for rank, step in ((2, 50), (0, 7), (3, 0)):
            r = kernel.execute(FAILING.format(rank=rank, step=step, after_backward=False), timeout=60)
            assert r.error["evalue"] == f"rank {rank} failed: ValueError: bad batch", r.traceback
            same = f"taas: ranks 0-3 stopped after optimizer step {step} of this cell, each with the same steps applied"
            assert (same in r.traceback) is (step > 0), r.traceback  # no line when no rank had begun a step
            assert f"released from their collectives as rank {rank} left them: " in r.traceback, r.traceback
            assert "the session goes on" in r.traceback and r.seconds < 10, r.traceback
            replicas = kernel.execute(REPLICAS).ok()
            assert replicas.each_rank().count("replicas 1") == 4, replicas.stdout
        r = kernel.execute(FAILING.format(rank=1, step=20, after_backward=True), timeout=60)
        assert (
            "the ranks stopped at different points of their training (ranks 0,2-3 after optimizer step 21 of this "
            "cell; rank 1 after optimizer step 20 of this cell): their models may differ now"
        ) in r.traceback, r.traceback
        trained = kernel.execute(TRAIN, interrupt_after=1.0, counted_from="training", timeout=60)
        assert trained.error["ename"] == "RunInterrupted", trained.traceback
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


IGNORES_INTERRUPTS = """#pragma taas --ranks 0
import time
while True:
    try:
        time.sleep(10)  # and every interrupt ignored
    except KeyboardInterrupt:
        pass
"""


def test_a_rank_that_does_not_leave_an_interrupted_cell_ends_the_session_with_its_stack(kernel):
    first = kernel.execute(START.format(start="fork")).ok()
    r = kernel.execute(IGNORES_INTERRUPTS, interrupt_after=1.5)
    assert "the session ended: rank 0 did not leave the interrupted cell within 5 s" in r.traceback, r.traceback
    assert "where they were:\nrank 0: in no collective" in r.traceback, r.traceback
    assert "time.sleep(10)  # and every interrupt ignored" in r.traceback and r.seconds < 20, r.seconds
    assert gone(pids(first).values(), 0)  # and the fixture checks that nothing else is left
    assert "session:             ended: rank 0 did not leave" in kernel.execute("%taas").ok().stdout
    assert (
        kernel.execute("%taas debug")
        .error["evalue"]
        .startswith("nothing to debug: the session ended (rank 0 did not leave the interrupted cell within 5 s")
    )
    # A cell that starts a session does not need the old one: it says so in a line, and starts another.
    again = kernel.execute(START.format(start="fork")).ok()
    assert "taas: the last session ended (rank 0 did not leave" in again.stderr, again.stderr
    assert "this cell starts another" in again.stderr
    stop(kernel)


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_rank_that_dies_is_replaced_by_a_new_process_and_the_session_goes_on(kernel, start):
    """The cell fails saying which rank died and how; a new process takes its place (the same RANK), given every
    name the other ranks hold alike, and the process group works with it in the next cell."""
    first = kernel.execute(START.format(start=start) + "shared = {'lr': 0.1}\n").ok()
    r = kernel.execute("#pragma taas\nimport time\nif mine == 1:\n    os._exit(3)\ntime.sleep(30)")
    try:
        assert r.error["evalue"] == "rank 1 failed: exited with code 3 before the cell finished", r.error
        assert "taas: the session goes on, a new process in place of rank 1" in r.traceback, r.traceback
        assert r.seconds < 30, r.seconds  # about 2 s here (benchmarks/session_faults.py); far more on a loaded machine
        healed = re.search(
            r"\[rank 1\] taas: rank 1 is a new process in place of the one that died: (\d+) names", r.stderr
        )
        assert healed and "taas: rank 0 is the only other rank, so nothing tells its own values" in r.stderr, r.stderr
        again = kernel.execute(
            "#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)\nt = torch.ones(1)\ndist.all_reduce(t)\n"
            "print('rank', dist.get_rank(), os.environ['RANK'], os.environ['TAAS_RUN_ID'] == run_id, shared, t.item(),"
            " mine)"
        ).ok()
        assert pids(again)[0] == pids(first)[0] and pids(again)[1] != pids(first)[1], "a new process, rank 0 the same"
        # rank 0's own `mine` came with the rest, as the line above said
        assert "[rank 1] rank 1 1 True {'lr': 0.1} 2.0 0" in again.each_rank(), again.each_rank()
        assert gone([pids(first)[1]], 0)
        assert "session:             up: 2 ranks on cpu" in kernel.execute("%taas").ok().stdout
        assert kernel.execute("%taas debug").error["evalue"].startswith("nothing to debug"), "its death is no error"
    finally:
        stop(kernel)
    assert gone(pids(again).values(), 5)  # and the fixture checks that nothing else is left


def test_a_rank_killed_between_cells_is_replaced_as_the_next_cell_begins(kernel):
    """Nothing runs when it dies (the out-of-memory killer picked it, someone typed kill -9): the next line of taas
    says so, and the next cell first puts a new process in its place, given the others' names."""
    first = kernel.execute(START.format(start="fork").replace("--gpus 2", "--gpus 3") + "shared = [1, 2]\n").ok()
    try:
        psutil.Process(pids(first)[2]).kill()
        assert gone([pids(first)[2]], 5)
        told = "taas: rank 2 killed by signal SIGKILL between cells: a new process takes its place"
        deadline = time.monotonic() + 10  # its supervisor reaps it and tells the kernel: a moment on a busy machine
        while told not in (shown := kernel.execute("%taas").ok()).stderr and time.monotonic() < deadline:
            time.sleep(0.2)
        assert told in shown.stderr, shown.stderr
        assert "session:             up: 3 ranks on cpu" in shown.stdout, shown.stdout
        r = kernel.execute(
            "#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)\nt = torch.ones(1)\ndist.all_reduce(t)\n"
            "print('sum', t.item(), shared, flush=True)"
        ).ok()
        assert "[rank 2] taas: rank 2 is a new process in place of the one that died" in r.stderr, r.stderr
        assert r.each_rank().count("sum 3.0 [1, 2]") == 3, r.each_rank()
        assert pids(r)[2] != pids(first)[2] and (pids(r)[0], pids(r)[1]) == (pids(first)[0], pids(first)[1])
    finally:
        stop(kernel)


DYING = """#pragma taas
import signal
print("training", flush=True)
for step in range(1_000_000):
    if dist.get_rank() == {rank} and step == {step}:
        {how}
    model(torch.randn(16, 32)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
DYING_ON_BATCHES = """#pragma taas
import signal
print("training", flush=True)
step = 0
while True:  # on batches that producers serve: 8 steps a pass
    for (x,) in batches:
        if dist.get_rank() == {rank} and step == {step}:
            {how}
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
"""
BATCHES = """from torch.utils.data import DataLoader, TensorDataset
batches = DataLoader(TensorDataset(torch.randn(512, 32)), batch_size=16, shuffle=True)
taas.register(batches)
"""
HOW = {
    "raise": ("raise ValueError('bad batch')", "ValueError: bad batch"),
    "SIGKILL": ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal SIGKILL"),
    "exit": ("os._exit(7)", "exited with code 7 before the cell finished"),
}


@pytest.mark.timeout(300)
def test_ddp_training_survives_any_rank_raising_or_dying_at_any_step_with_equal_replicas(kernel):
    """One session through several failures in a row, training on a registered loader its producers serve:
    whichever rank raises, is killed or exits, at whichever step, the cell says so, a dead rank is replaced within
    seconds (with its share of the loader), and the same DDP training goes on with equal replicas."""

    @settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
    @given(rank=st.integers(0, 3), step=st.integers(0, 40), how=st.sampled_from(list(HOW)))
    def one_failure(rank: int, step: int, how: str) -> None:
        before = pids(kernel.execute("#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)").ok())
        r = kernel.execute(DYING_ON_BATCHES.format(rank=rank, step=step, how=HOW[how][0]), timeout=60)
        assert r.error["evalue"] == f"rank {rank} failed: {HOW[how][1]}", r.traceback
        assert "the session goes on" in r.traceback and r.seconds < 30, (r.seconds, r.traceback)  # a loaded machine
        after = pids(kernel.execute("#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)").ok())
        replaced = {peer for peer in range(4) if after[peer] != before[peer]}
        assert replaced == (set() if how == "raise" else {rank}), (replaced, how, rank)
        replicas = kernel.execute(REPLICAS).ok()
        assert replicas.each_rank().count("replicas 1") == 4, replicas.stdout
        trained = kernel.execute(TRAIN, interrupt_after=0.5, counted_from="training", timeout=60)
        assert "each with the same steps applied" in trained.traceback, trained.traceback

    kernel.execute("import torch, taas\n" + BATCHES).ok()
    kernel.execute(START.format(start="fork").replace("--gpus 2", "--gpus 4") + DDP).ok()
    try:
        one_failure()
    finally:
        stop(kernel)
        kernel.execute("taas.unregister(batches)").ok()


def forget_the_ended_session(kernel) -> None:
    """After a session ended in a cell, the next cell meant for it says so and does not run."""
    r = kernel.execute("#pragma taas\nprint('meant for the session')")
    assert r.error["ename"] == "SessionEnded" and "This cell did not run" in r.traceback, r.traceback
    assert "session:             none" in kernel.execute("%taas").ok().stdout


def test_sys_exit_in_a_session_ends_it(kernel):
    kernel.execute(START.format(start="fork")).ok()
    r = kernel.execute("#pragma taas\nimport sys\nsys.exit()")
    assert re.search(
        r"the session ended: rank \d ended the session with sys.exit\(\): its process group cannot "
        "continue",
        r.traceback,
    ), r.traceback
    forget_the_ended_session(kernel)


def test_the_idle_limit_ends_a_forgotten_session(kernel):
    first = kernel.execute(START.format(start="fork").replace("--keep", "--keep --idle 1")).ok()
    assert gone(pids(first).values(), 10), "the session's ranks are gone after its idle limit"
    shown = kernel.execute("%taas").ok().stdout
    assert "ended: the session was idle for 1 s, its limit (--idle)" in shown, shown
    r = kernel.execute("#pragma taas\nprint(mine)")
    assert "the session ended: the session was idle for 1 s" in r.traceback and "This cell did not run" in r.traceback
    kernel.execute("#pragma taas\nprint('one-shot again')").ok()


def test_a_kernel_restart_ends_the_session(fresh_kernel):
    first = fresh_kernel.execute(START.format(start="forkserver")).ok()
    assert len(pids(first)) == 2 and not gone(pids(first).values(), 0)
    fresh_kernel.manager.restart_kernel(now=True)
    assert gone(pids(first).values(), 3), "a session's ranks are gone within 3 s of the kernel's death"


def test_options_that_would_change_the_session_are_refused_before_anything_runs(kernel):
    assert kernel.execute("#pragma taas --ranks 0\nx = 1").error["evalue"] == (
        "--ranks 0 runs a cell in part of a session, and none is running: start one with --keep"
    )
    assert "--idle 5 applies to a session: add --keep" in kernel.execute("#pragma taas --idle 5\nx = 1").error["evalue"]
    kernel.execute(START.format(start="fork")).ok()
    try:
        r = kernel.execute("#pragma taas --gpus 4\nx = 1")
        assert r.error["evalue"].startswith("--gpus 4: the session has 2 ranks: %taas resize 4 changes them")
        r = kernel.execute("#pragma taas --gpus 4 --start forkserver\nx = 1")
        assert r.error["evalue"].startswith("--gpus, --start would change the running session (2 ranks on cpu)")
        r = kernel.execute("#pragma taas --cpus 2\nx = 1")
        assert r.error["evalue"].startswith("--cpus cannot apply to a cell in a session")
        assert kernel.execute("#pragma taas --gpus 2 --keep\nx = 1").error["evalue"].startswith("a session is running")
        assert kernel.execute("#pragma taas --gpus 2\nprint('fine')").ok(), "the session's own size is no change"
        nothing = kernel.execute("%taas debug")
        assert nothing.error["evalue"].startswith("nothing to debug")
    finally:
        stop(kernel)
    assert kernel.execute("%taas stop").ok().stdout.strip() == "taas: no session is running"


# -- the debugger -------------------------------------------------------------------------------
def test_taas_debug_opens_the_debugger_in_the_failing_rank_and_the_session_goes_on(kernel):
    kernel.execute(START.format(start="forkserver")).ok()
    try:
        kernel.execute(
            "#pragma taas\ndef step(v):\n    inside = v * 7\n    raise ValueError('boom')\nif mine == 1:\n    step(6)"
        )
        r = kernel.execute("%taas debug", answers=["p inside", "up", "p mine", "q"]).ok()
        assert r.prompts == ["[rank 1] (Pdb) "] * 4, r.prompts
        assert "[rank 1] 42" in r.each_rank() and "[rank 1] 1" in r.each_rank(), r.each_rank()
        kernel.execute("#pragma taas\ndist.barrier()\nprint('after', mine)").ok()
    finally:
        stop(kernel)


@pytest.mark.parametrize("keep", [True, False])
def test_breakpoint_stops_its_rank_in_the_debugger_in_the_cells_output(kernel, keep):
    if keep:
        kernel.execute(START.format(start="fork")).ok()
        header = "#pragma taas"
    else:
        header = "#pragma taas --gpus 2\nimport os\nmine = int(os.environ['RANK'])"
    try:
        r = kernel.execute(
            f"{header}\nx = 5\nif mine == 1:\n    breakpoint()\n    x = 6\ny = x", answers=["p x", "n", "p x", "c"]
        ).ok()
        assert (
            r.prompts == ["[rank 1] (Pdb) "] * 4 and "[rank 1] 5\n" in r.each_rank() and "[rank 1] 6\n" in r.each_rank()
        )
        assert kernel.value("y") == 5
    finally:
        if keep:
            stop(kernel)


def test_a_breakpoint_without_a_front_end_to_answer_continues(kernel):
    r = kernel.execute("#pragma taas --gpus 2\nbreakpoint()\ndone = True").ok()
    assert "no input can be read here: the debugger continues" in r.stderr and kernel.value("done") is True


def test_debug_keeps_a_one_shot_runs_failing_rank_for_the_debugger(kernel):
    r = kernel.execute(
        "#pragma taas --gpus 2 --debug\nimport os, time\ndef load():\n    path = 'shard-1'\n"
        "    raise KeyError(path)\nif os.environ['RANK'] == '1':\n    load()\ntime.sleep(30)"
    )
    assert r.error["evalue"] == "rank 1 failed: KeyError: 'shard-1'" and r.seconds < 10
    assert "rank 1 is paused at its error: %taas debug opens the debugger there" in r.stderr
    assert len(kernel.children()) >= 1, "the paused rank and its supervisor stay"
    r = kernel.execute("%taas debug", answers=["p path", "q"]).ok()
    assert "[rank 1] 'shard-1'" in r.each_rank()
    deadline = time.monotonic() + 5
    while kernel.children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not kernel.children(), "once the debugger is left, the run is over"
    kernel.execute("#pragma taas --gpus 2 --debug\nraise ValueError('again')")
    assert kernel.execute("#pragma taas\nx = 1").ok(), "the next cell lets the paused rank go"


def test_taas_progress_shows_in_a_sessions_cells(kernel):
    kernel.execute(START.format(start="fork")).ok()
    try:
        r = kernel.execute(
            "#pragma taas\nimport taas\nfor step in range(5):\n    taas.progress(step=step, acc=0.5)"
        ).ok()
        summary = [d["text/plain"] for d in r.displays][-1].splitlines()
        assert summary[0].startswith("taas: 2 ranks on cpu · done in "), summary
        rows = view_rows("\n".join(summary))
        assert [re.sub(r" +", " ", line).endswith("step 4, acc 0.5") for line in rows] == [True, True], summary
    finally:
        stop(kernel)


# -- kernel-level commands while a session runs ---------------------------------------------------
def test_reload_ext_keeps_the_session_its_ranks_and_the_configured_defaults(kernel):
    first = kernel.execute(START.format(start="forkserver")).ok()
    try:
        kernel.execute("%config TaasMagics.output = 'rank0'").ok()
        kernel.execute("#pragma taas\nsteps = 100").ok()
        kernel.execute("%reload_ext taas_magic").ok()
        r = kernel.execute(
            "#pragma taas\nsteps += 100\nprint('pid ' + str(os.getpid()) + ' steps ' + str(steps), flush=True)\n"
            "dist.barrier()"
        ).ok()
        assert r.stdout == f"pid {pids(first)[0]} steps 200\n", "the session's own rank 0, alone (--output rank0 kept)"
        assert "session:             up: 2 ranks" in kernel.execute("%taas").ok().stdout
    finally:
        kernel.execute("%config TaasMagics.output = 'all'").ok()
        stop(kernel)


def test_unload_ext_ends_the_session_in_one_line_and_the_next_cell_after_loading_does_not_run(kernel):
    first = kernel.execute(START.format(start="fork")).ok()
    r = kernel.execute("%unload_ext taas_magic").ok()
    assert "taas: taas_magic was unloaded (%unload_ext): the session ended; its 2 ranks are gone" in r.stderr, r.stderr
    assert gone(pids(first).values(), 5)
    kernel.execute("%load_ext taas_magic").ok()
    r = kernel.execute("#pragma taas\nprint('ran', flush=True)")
    assert r.error is not None and "ran" not in r.stdout
    assert r.error["evalue"] == "the session ended: taas_magic was unloaded (%unload_ext)", r.error["evalue"]
    kernel.execute("#pragma taas\nprint('one-shot again')").ok()


# -- a person at a debugger prompt: --timeout, --max-restarts, interrupts ----------------------------
ONE_SHOT = "#pragma taas --gpus 2 {options}\nimport os\nmine = int(os.environ['RANK'])"


@pytest.mark.parametrize("keep", [True, False])
def test_time_at_a_debugger_prompt_does_not_count_toward_timeout(kernel, keep):
    if keep:
        kernel.execute(START.format(start="fork")).ok()
    header = "#pragma taas --timeout 2" if keep else ONE_SHOT.format(options="--timeout 2")
    try:
        r = kernel.execute(
            f"{header}\nx = 5\nif mine == 1:\n    breakpoint()\n    x = 6\ny = x + 1", answers=["p x", "c"], think=1.5
        ).ok()
        assert r.prompts == ["[rank 1] (Pdb) "] * 2 and r.seconds > 3, "3 s at the prompt, 2 s of --timeout"
        assert kernel.value("y") == 6, "rank 0's names came back"
        late = kernel.execute(f"{header}\nif mine == 1:\n    breakpoint()\ntime.sleep(30)", answers=["c"], think=1.5)
        assert late.error is not None and late.error["evalue"].startswith(
            "--timeout 2 s elapsed: ranks 0-1 still running, now"
        ), "the clock runs again after the prompt"
        assert 3.5 < late.seconds < 15, late.seconds
    finally:
        if keep:
            stop(kernel)


@pytest.mark.parametrize("how", ["q", "interrupt"])
def test_quitting_the_debugger_ends_a_one_shot_run_as_an_interrupt_and_never_restarts_it(kernel, how):
    code = ONE_SHOT.format(options="--max-restarts 2") + "\nif mine == 1:\n    breakpoint()\ntime.sleep(30)"
    if how == "q":
        r = kernel.execute(code, answers=["q"])
    else:
        r = kernel.execute(code, answers=[], think=60, interrupt_after=3.0)
    assert r.error is not None and r.error["ename"] == "RunInterrupted", r.error
    assert (
        "taas run interrupted; every rank stopped (rank 0: KeyboardInterrupt; rank 1: quit the debugger)" in r.traceback
    ), r.traceback
    assert "starts again" not in r.stderr and r.prompts == ["[rank 1] (Pdb) "], (r.stderr, r.prompts)
    assert r.seconds < 15


@pytest.mark.parametrize("how", ["q", "interrupt"])
def test_quitting_the_debugger_in_a_session_interrupts_the_cell_and_the_session_goes_on(kernel, how):
    first = kernel.execute(START.format(start="fork")).ok()
    try:
        code = "#pragma taas\nif mine == 1:\n    breakpoint()\ntime.sleep(30)"
        if how == "q":
            r = kernel.execute(code, answers=["q"])
        else:
            r = kernel.execute(code, answers=[], think=60, interrupt_after=3.0)
        assert r.error is not None and r.error["ename"] == "RunInterrupted", r.error
        assert r.error["evalue"] == (
            "KeyboardInterrupt: the debugger was quit in rank 1; taas interrupted the cell "
            "in rank 0; the session goes on"
        ), r.error["evalue"]
        assert r.seconds < 15
        assert_same_ranks_go_on(kernel, first)
    finally:
        stop(kernel)


@pytest.mark.parametrize("keep", [True, False])
def test_a_prompt_that_comes_after_another_rank_failed_is_not_put_to_the_user(kernel, keep):
    if keep:
        kernel.execute(START.format(start="fork")).ok()
    header = "#pragma taas" if keep else ONE_SHOT.format(options="")
    try:
        r = kernel.execute(
            f"{header}\nif mine == 1:\n    breakpoint()\n    print('after the prompt', flush=True)\n"
            "    time.sleep(30)\nelse:\n    time.sleep(0.5)\n    raise ValueError('boom')",
            answers=["p 41 + 1"],
            think=2.0,
        )
        assert r.error is not None and r.error["evalue"] == "rank 0 failed: ValueError: boom", r.traceback + r.stdout
        assert r.prompts == ["[rank 1] (Pdb) "] and "[rank 1] 42" in r.each_rank(), r.prompts
        assert "[rank 1] after the prompt\n" not in r.each_rank() and r.seconds < 10, r.traceback
        if keep:
            assert "the session goes on" in r.traceback
            again = kernel.execute("#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)").ok()
            assert_same_ranks_go_on(kernel, again)
    finally:
        if keep:
            stop(kernel)


# -- %taas stacks: where a session's processes are between cells --------------------------------------
def test_taas_stacks_says_once_that_every_rank_of_an_idle_session_waits_for_the_next_cell(kernel):
    kernel.execute(START.format(start="fork")).ok()
    try:
        r = kernel.execute("%taas stacks").ok()
        assert r.stdout == "ranks 0-1: idle, waiting for the next cell\n", r.stdout
        assert r.seconds < 5, "the ranks answer at once: nothing waits for a timeout"
    finally:
        stop(kernel)


def test_taas_stacks_shows_a_thread_the_users_cell_left_blocked_under_its_rank(kernel):
    kernel.execute(START.format(start="forkserver")).ok()
    try:
        kernel.execute(
            "#pragma taas\nimport threading, time\ndef stuck():\n    time.sleep(600)\n"
            "if mine == 1:\n    threading.Thread(target=stuck, daemon=True).start()"
        ).ok()
        r = kernel.execute("%taas stacks").ok()
        lines = r.stdout.splitlines()
        assert lines[:3] == [
            "rank 0: idle, waiting for the next cell",
            "rank 1: idle, waiting for the next cell:",
            "    another thread:",
        ], r.stdout
        assert re.fullmatch(r"    Cell In\[\d+\], line 4 in stuck", lines[3]), r.stdout
        assert lines[4] == "      time.sleep(600)", r.stdout
        assert all("taas_magic" not in line for line in lines), "taas's own threads and frames are left out"
    finally:
        stop(kernel)


def test_taas_stacks_shows_the_sessions_data_producers_by_name(kernel):
    kernel.execute(
        "import taas, torch\nfrom torch.utils.data import DataLoader\n"
        "steps = DataLoader(torch.arange(64), batch_size=4)\ntaas.register(steps)"
    ).ok()
    try:
        kernel.execute("#pragma taas --gpus 2 --keep --cpus 2\nn = sum(1 for _ in steps)").ok()
        # After the cell, the producers prepare the next pass as far as --prefetch allows
        # (docs/data-delivery.md), then wait: on a busy machine a CI run found them still preparing.
        expected = (
            "ranks 0-1: idle, waiting for the next cell\n"
            "producer 0 of steps; producer 1 of steps: idle, waiting for the ranks\n"
        )
        deadline = time.monotonic() + 30
        while (r := kernel.execute("%taas stacks").ok()).stdout != expected and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.stdout == expected, r.stdout
    finally:
        stop(kernel)
        kernel.execute("taas.unregister(steps)").ok()


def test_taas_stacks_without_a_session_says_so_in_one_line(kernel):
    r = kernel.execute("%taas stacks").ok()
    assert r.stdout == "taas: no session is running (a taas cell with --keep starts one)\n", r.stdout
    bad = kernel.execute("%taas stacks 1")
    assert bad.error is not None and bad.error["evalue"] == "%taas stacks takes nothing more; got '1'", bad.error


def test_tab_completion_offers_taas_stacks(kernel):
    assert "stacks" in kernel.complete("%taas sta")
