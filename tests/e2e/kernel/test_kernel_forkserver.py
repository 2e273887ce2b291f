"""The CUDA-safe start: ranks from the fork server, with what the cell needs shipped by value."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from support.kernel import Kernel, processes_of_run, still_running

WARM_FORK_SERVER = True  # the fork server at load: its pid, its state, what it imported (tests/e2e/conftest.py)

DEFINITIONS = """
import threading, torch
SCALE = 3
weights = torch.arange(6.0).reshape(2, 3)
def scaled(x):
    return x * SCALE + weights.sum().item()
class Counter:
    def __init__(self, start):
        self.value = start
    def bump(self):
        self.value += SCALE
        return self.value
square = lambda v: v * v
lock = threading.Lock()
"""

CELL = """import os, taas
SCALE = 10  # functions from earlier cells see what the cell binds, as in the kernel
counter = Counter(taas.rank())
answer = (scaled(1), counter.bump(), square(4), weights.shape[1], taas.rank(), taas.world_size())
print("ANSWER", answer)
"""


@pytest.fixture(scope="module")
def defined(kernel):
    kernel.execute(DEFINITIONS).ok()
    return kernel


def answers(result) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"\[rank (\d+)\] ANSWER (.*)", result.stdout)}


def test_spawned_ranks_see_functions_classes_lambdas_and_tensors_from_earlier_cells(defined):
    result = defined.execute("#pragma taas --gpus 2 --start forkserver\n" + CELL).ok()
    assert answers(result) == {0: "(25.0, 10, 16, 3, 0, 2)", 1: "(25.0, 11, 16, 3, 1, 2)"}
    assert defined.value("answer") == (25.0, 10, 16, 3, 0, 2), "rank 0's values come back"
    assert defined.value("counter.value") == 10
    assert defined.value("SCALE") == 10


def test_a_cell_that_works_with_fork_works_the_same_from_the_fork_server(defined):
    defined.execute("SCALE = 3").ok()
    forked = defined.execute("#pragma taas --gpus 2 --start fork\n" + CELL).ok()
    defined.execute("SCALE = 3").ok()
    spawned = defined.execute("#pragma taas --gpus 2 --start forkserver\n" + CELL).ok()
    assert answers(forked) == answers(spawned)


def test_a_needed_name_that_cannot_be_shipped_fails_before_anything_starts(defined):
    result = defined.execute("#pragma taas --gpus 2 --start forkserver\nwith lock:\n    print('started')")
    assert result.error["ename"] == "TaasUsageError"
    assert result.error["evalue"].startswith("the cell needs 'lock' (a _thread.lock)")
    assert "create it inside the cell" in result.error["evalue"]
    assert "started" not in result.stdout
    # The same lock, not needed by the cell, is ignored.
    assert (
        defined.execute("#pragma taas --gpus 2 --start forkserver --output rank0\nprint(square(3))").ok().stdout
        == "9\n"
    )


def test_auto_picks_the_fork_server_when_the_kernel_reports_cuda_initialized(defined):
    defined.execute("import torch\n_real = torch.cuda.is_initialized\ntorch.cuda.is_initialized = lambda: True").ok()
    try:
        result = defined.execute(GRANDPARENT).ok()
        assert "the ranks start from the fork server (--start forkserver)" in result.stderr
        assert int(result.stdout) == defined.fork_server().pid, (
            "ranks come from the run's supervisor, forked by the server"
        )
    finally:
        defined.execute("torch.cuda.is_initialized = _real").ok()
    result = defined.execute(GRANDPARENT).ok()
    assert int(result.stdout) == defined.pid, "fork again once CUDA is not initialized"


GRANDPARENT = "#pragma taas --gpus 2 --output rank0\nimport os, psutil\nprint(psutil.Process(os.getppid()).ppid())"


def test_the_fork_server_survives_many_cells_without_leaking(defined):
    server = defined.fork_server()
    defined.execute("#pragma taas --gpus 2 --start forkserver\nx = weights.sum()").ok()
    fds, memory = server.num_fds(), server.memory_info().rss
    for _ in range(12):
        defined.execute("#pragma taas --gpus 2 --start forkserver\nx = weights.sum() + SCALE").ok()
    assert defined.fork_server().pid == server.pid, "the same fork server served every cell"
    deadline = time.monotonic() + 2
    while server.children() and time.monotonic() < deadline:
        time.sleep(0.01)  # the last run's supervisor said the run was over and may still be exiting
    assert server.children() == [], "each run's supervisor is reaped as soon as it ends"
    assert server.num_fds() <= fds, f"{server.num_fds()} descriptors, {fds} after the first cell: " + ", ".join(
        f"{fd}->{os.readlink(f'/proc/{server.pid}/fd/{fd}')}" for fd in os.listdir(f"/proc/{server.pid}/fd")
    )
    assert server.memory_info().rss < memory + 64 * 2**20, (memory, server.memory_info().rss)
    maps = open(f"/proc/{server.pid}/maps").read()
    assert maps.count("taas-tensors") <= 1, "the shipped tensors of past runs are unmapped"


def test_tensors_are_shipped_once_through_shared_memory(defined):
    defined.execute("big = torch.ones(8 * 2**20)  # 32 MB").ok()
    result = defined.execute("""#pragma taas --gpus 2 --start forkserver
import os, taas
print("SUM", big.sum().item(), os.getpid())
big.add_(taas.rank())  # a rank's writes stay its own
print("AFTER", big[0].item())
""").ok()
    assert result.each_rank().count("SUM 8388608.0") == 2
    assert "[rank 0] AFTER 1.0" in result.each_rank() and "[rank 1] AFTER 2.0" in result.each_rank()
    assert defined.value("big[0].item()") == 1.0


def test_interrupt_and_failure_work_through_the_fork_server(defined):
    result = defined.execute(
        """#pragma taas --gpus 2 --start forkserver
import os, time, taas
print("RUN", os.environ["TAAS_RUN_ID"], flush=True)
try:
    time.sleep(60)
finally:
    print("cleanup", taas.rank(), flush=True)
""",
        interrupt_after=2.5,
        timeout=30,
    )
    assert "KeyboardInterrupt" in result.traceback
    assert "[rank 0] cleanup 0" in result.each_rank() and "[rank 1] cleanup 1" in result.each_rank()
    run_id = re.search(r"RUN (taas-\w+)", result.stdout)[1]
    assert processes_of_run(run_id) == []
    result = defined.execute("#pragma taas --gpus 2 --start forkserver\nimport taas\nif taas.rank():\n    1 / 0")
    assert result.error["evalue"] == "rank 1 failed: ZeroDivisionError: division by zero"
    assert "Cell In[" in result.traceback and "1 / 0" in result.traceback


def test_breakpoint_from_the_fork_server_shows_the_lines_around_it_as_a_forked_rank_does(defined):
    """ipykernel makes IPython's debugger ``pdb.Pdb`` in the kernel, and forked ranks inherit it; a rank
    the fork server starts has plain pdb, which showed only the ``->`` line."""
    r = defined.execute(
        "#pragma taas --gpus 2 --start forkserver\nimport os\nx = 5\nif os.environ['RANK'] == '1':\n"
        "    breakpoint()\n    x = 6\ny = x",
        answers=["c"],
    ).ok()
    assert r.prompts == ["[rank 1] (Pdb) "]
    assert re.search(
        r"^\[rank 1\] > .*\(6\)<module>\(\)\n"
        r"\[rank 1\]       3 x = 5\n\[rank 1\]       4 if os.environ\['RANK'\] == '1':\n"
        r"\[rank 1\]       5     breakpoint\(\)\n\[rank 1\] ----> 6     x = 6\n"
        r"\[rank 1\]       7 y = x$",
        r.stdout,
        re.M,
    ), r.stdout


def test_only_rank_0_writes_from_the_fork_server_too(defined, tmp_path):
    target = tmp_path / "w.pt"
    result = defined.execute(
        f"#pragma taas --gpus 2 --start forkserver\nimport taas\ntorch.save(taas.rank(), {str(target)!r})"
    ).ok()
    assert "skipped in rank 1" in result.stderr
    import torch

    assert torch.load(target) == 0


def test_a_dead_fork_server_is_restarted(fresh_kernel):
    fresh_kernel.execute("#pragma taas --gpus 2 --start forkserver\nx = 1").ok()
    server = fresh_kernel.fork_server()
    server.kill()  # while idle: the next cell must not notice, whenever the server's death is seen
    result = fresh_kernel.execute("#pragma taas --gpus 2 --start forkserver --output rank0\nprint('back')").ok()
    assert result.stdout == "back\n"
    assert fresh_kernel.fork_server().pid != server.pid


def test_unload_stops_the_fork_server_and_kernel_death_takes_it_along(fresh_kernel):
    server = fresh_kernel.fork_server()
    fresh_kernel.execute("%unload_ext taas_magic").ok()
    server.wait(10)
    assert fresh_kernel.fork_server() is None
    fresh_kernel.execute("%load_ext taas_magic").ok()
    fresh_kernel.client.execute(
        "#pragma taas --gpus 2 --start forkserver\nimport time\nprint('up', flush=True)\ntime.sleep(60)"
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(fresh_kernel.children()) < 3:
        time.sleep(0.1)
    family = fresh_kernel.children() + [fresh_kernel.fork_server()]
    assert len(family) == 4, "the run's supervisor, its 2 ranks, the fork server"
    os.kill(fresh_kernel.pid, signal.SIGKILL)
    assert still_running(family, timeout=3) == []


def test_a_kernel_told_not_to_warm_the_fork_server_starts_it_with_its_first_forkserver_cell():
    """TaasMagics.warm_fork_server = False: no fork server (nor its torch import) until a cell needs one."""
    kernel = Kernel(warm_fork_server=False)
    try:
        time.sleep(2)  # a warm-up would have begun by now
        assert kernel.fork_server() is None
        shown = kernel.execute("%taas").ok().stdout
        assert "fork server:         not started (it starts with the first forkserver cell)" in shown, shown
        assert kernel.execute("#pragma taas --gpus 2 --output rank0\nprint('forked')").ok().stdout == "forked\n"
        assert kernel.fork_server() is None, "a fork cell needs no fork server"
        kernel.execute("SCALE = 3").ok()
        result = kernel.execute("#pragma taas --gpus 2 --start forkserver --output rank0\nprint(SCALE)", timeout=120)
        assert result.ok().stdout == "3\n"
        assert kernel.fork_server() is not None, "started by the cell, and kept for the next"
    finally:
        kernel.shutdown()
