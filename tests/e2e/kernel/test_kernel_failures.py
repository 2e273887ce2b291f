"""When things go wrong in a taas cell: errors, crashes, timeouts, interrupts, a dying kernel.

Each ends the cell promptly with an error the user can act on, and leaves nothing behind.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from support.kernel import processes_of_run, still_running, view_rows

WARM_FORK_SERVER = True  # the kernel's death takes its warm fork server along (tests/e2e/conftest.py)

# DataLoader workers that are busy for a long time: grandchildren of the kernel to be cleaned up.
SLOW_WORKERS = """import time
from torch.utils.data import DataLoader
class Slow:
    def __len__(self): return 1000
    def __getitem__(self, i):
        time.sleep(1)
        return i
loader = iter(DataLoader(Slow(), num_workers=2))
"""

RUN_ID = "import os; print('RUN', os.environ['TAAS_RUN_ID'], flush=True) if os.environ['RANK'] == '0' else None\n"


def run_id_of(result) -> str:
    return re.search(r"RUN (taas-\w+)", result.stdout)[1]


def test_a_raising_rank_fails_the_cell_with_its_own_traceback_while_others_wait(kernel):
    kernel.execute("def check(x):\n    if x == 1:\n        raise ValueError(f'bad value {x}')\n").ok()
    result = kernel.execute(
        """#pragma taas --gpus 3
"""
        + RUN_ID
        + """import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    check(dist.get_rank())
dist.all_reduce(torch.ones(1))  # ranks 0 and 2 block here, waiting for rank 1
""",
        timeout=30,
    )
    assert result.error is not None
    assert result.seconds < 10
    assert result.error["ename"] == "RankFailed"
    assert result.error["evalue"] == "rank 1 failed: ValueError: bad value 1"
    tb = result.traceback
    assert "check(dist.get_rank())" in tb and "raise ValueError(f'bad value {x}')" in tb
    assert re.search(r"line 6", tb), "line numbers are the cell's own"
    assert "taas_magic" not in tb and "worker.py" not in tb
    assert "stopped after the failure: ranks 0,2" in tb
    assert processes_of_run(run_id_of(result)) == []
    assert kernel.execute("print('still usable')").ok().stdout == "still usable\n"


@pytest.mark.parametrize("world", [3, 4])
def test_peers_whose_collective_a_failure_broke_read_the_same_in_every_run(kernel, world):
    """gloo breaks the peers' all_reduce the moment rank 1 exits; whether taas sees that exit or the peers'
    own errors first must not change a word of the report, nor a row of the view.

    The peers are in all_reduce when rank 1 fails: gloo's ``init_process_group`` returns in each rank once
    its own connections are made, so without the barrier a busy machine saw rank 1 fail while ranks 0 and 2
    were still connecting ("ranks 0,2: in process-group setup", a true report of another state), and rank 1
    waits a moment after it for the peers to go from the barrier into all_reduce."""
    kernel.execute("def check(x):\n    if x == 1:\n        raise ValueError(f'bad value {x}')\n").ok()
    others = ",".join(str(rank) for rank in range(world) if rank != 1)
    for _ in range(6):
        result = kernel.execute(
            f"""#pragma taas --gpus {world}
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(0.5)
    check(dist.get_rank())
dist.all_reduce(torch.ones(1))
""",
            timeout=40,
        )
        tb = result.traceback
        assert result.error["evalue"] == "rank 1 failed: ValueError: bad value 1", tb
        after = tb.splitlines()[tb.splitlines().index("ValueError: bad value 1") + 1 :]
        peers = "0,2" if world == 3 else "0,2-3"
        assert after[:2] == [f"stopped after the failure: ranks {peers}", "where they were when rank 1 failed:"], tb
        # One place for all: in all_reduce at the same line. A peer still waiting when taas asked for its stacks
        # is read with its position of that moment (the collective's number and tensors); one whose collective
        # broke first is placed by its error's frames alone.
        who, _, doing = after[2].partition(": ")
        said = {re.sub(r"^ranks? [\d,-]+ | #\d+ \([^)]*\)| for \d+ s", "", part) for part in doing[:-1].split("; ")}
        assert (who, said, doing[-1:]) == (f"ranks {peers}", {"in all_reduce"}, ":"), tb
        assert after[3].strip().startswith("in all_reduce (torch/distributed/distributed_c10d.py"), tb
        assert "also failed" not in tb and "Connection" not in tb + result.stderr and "pair.cc" not in tb, tb
        rows = [line.split()[:3] for line in view_rows(result.displays[-1]["text/plain"])]
        assert rows == [["rank", str(rank), "failed" if rank == 1 else "stopped"] for rank in range(world)], rows
        broken = kernel.value("sorted(sys.last_value.peer_errors)")
        assert set(broken) <= {int(rank) for rank in others.split(",")}
        assert all("Connection" in error for error in kernel.value("list(sys.last_value.peer_errors.values())"))


def test_peers_stopped_while_their_traceback_is_formatted_still_say_where_they_were(kernel):
    """IPython's formatting of a broken peer's traceback can outlast the stop's 3 s before SIGKILL on a busy
    machine (it parses torch's distributed_c10d.py): the peer said where it was before it began."""
    kernel.execute(
        "import time, taas_magic.rank.cell as _cell\n"
        "_formatter = _cell.format_traceback\n"
        "def _slowly_for_peers(error, shell):\n"
        "    if 'peer' in str(error).lower():\n"
        "        time.sleep(10)\n"
        "    return _formatter(error, shell)\n"
        "_cell.format_traceback = _slowly_for_peers\n"
        "def check(x):\n    if x == 1:\n        raise ValueError(f'bad value {x}')\n"
    ).ok()
    try:
        result = kernel.execute(
            "#pragma taas --gpus 3\nimport torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
            "if dist.get_rank() == 1:\n    check(1)\ndist.all_reduce(torch.ones(1))\n",
            timeout=40,
        )
    finally:
        kernel.execute("_cell.format_traceback = _formatter").ok()
    tb = result.traceback
    after = tb.splitlines()[tb.splitlines().index("ValueError: bad value 1") + 1 :]
    # Where they were, taken as rank 1 failed; on a busy machine a second or two later ("in all_reduce #1 (…) for 2 s"),
    # or each rank in its own words where one had sampled its collective and the other not yet ("ranks 0,2: rank 0
    # in all_reduce #1 (4 B float32) for 1 s; rank 2 in all_reduce:", seen once beside a cluster test)
    assert after[:2] == ["stopped after the failure: ranks 0,2", "where they were when rank 1 failed:"], tb
    together = after[2].startswith("ranks 0,2: in all_reduce")
    assert together or re.match(r"ranks 0,2: rank 0 in all_reduce.*; rank 2 in all_reduce", after[2]), tb
    assert result.seconds < 10, result.seconds  # the stop did not wait for the formatting


def test_a_restarted_runs_report_and_a_paused_rank_are_the_failures_not_the_broken_peers(kernel):
    kernel.execute("def check(x):\n    if x == 1:\n        raise ValueError(f'bad value {x}')\n").ok()
    cell = (
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n    check(1)\ndist.all_reduce(torch.ones(1))\n"
    )
    restarted = kernel.execute("#pragma taas --gpus 3 --max-restarts 1\n" + cell, timeout=60)
    assert restarted.stderr.startswith(
        "taas: rank 1 failed: ValueError: bad value 1: every rank starts again (restart 1 of --max-restarts 1)\n"
    ), restarted.stderr
    assert restarted.error["evalue"] == "rank 1 failed: ValueError: bad value 1"
    assert "stopped after the failure: ranks 0,2" in restarted.traceback and "Connection" not in restarted.traceback
    paused = kernel.execute("#pragma taas --gpus 3 --debug\n" + cell, timeout=60)
    assert "taas: rank 1 is paused at its error" in paused.stderr, paused.stderr
    debugged = kernel.execute("%taas debug", answers=["p x", "q"], timeout=30)
    assert "[rank 1] 1" in debugged.stdout, debugged.stdout


def test_when_several_ranks_fail_the_first_is_shown_and_the_others_listed(kernel):
    result = kernel.execute("""#pragma taas --gpus 2
import signal, time, taas
if taas.rank() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # keeps running after taas's SIGTERM, until SIGKILL at 3 s
    time.sleep(0.5)
    raise RuntimeError("second")
raise KeyError("first")
""")
    assert result.error["evalue"] == "rank 1 failed: KeyError: 'first'"
    assert "also failed, after rank 1: rank 0 (RuntimeError: second)" in result.traceback


def test_the_same_error_in_every_rank_is_read_once_labelled_with_its_ranks(kernel):
    kernel.execute("def load(path):\n    raise FileNotFoundError(path)\n").ok()
    result = kernel.execute("#pragma taas --gpus 4\nload('weights.pt')\n", timeout=30)
    first = re.fullmatch(r"rank (\d) failed: FileNotFoundError: weights.pt", result.error["evalue"])
    tb = result.traceback
    assert first and f"[ranks 0-3] traceback (rank {first[1]} failed first):" in tb, tb
    assert tb.count("raise FileNotFoundError(path)") == 1, tb
    assert "also failed" not in tb


@pytest.mark.parametrize(
    "death, expected",
    [
        ("os._exit(7)", "rank 1 failed: exited with code 7 before the cell finished"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "rank 1 failed: killed by signal SIGKILL"),
        ("import ctypes; ctypes.string_at(0)", "rank 1 failed: killed by signal SIGSEGV"),
    ],
    ids=["os._exit", "SIGKILL", "segfault"],
)
def test_a_rank_that_dies_is_reported_with_its_exit_code_or_signal(kernel, death, expected):
    result = kernel.execute(
        f"""#pragma taas --gpus 2
import os, signal, sys, taas, time
if taas.rank() == 1:
    print("last words", file=sys.stderr)
    {death}
time.sleep(30)
""",
        timeout=30,
    )
    assert result.error["evalue"] == expected
    assert result.seconds < 10
    assert "[rank 1] last words" in result.each_rank("stderr")
    assert "last words" in result.traceback, "the crash report shows what the rank wrote last"


def test_sys_exit_zero_is_success_and_nonzero_a_failure(kernel):
    kernel.execute("#pragma taas --gpus 2\nimport sys\nsys.exit(0)").ok()
    result = kernel.execute("#pragma taas --gpus 2\nimport sys, taas\nsys.exit(3 if taas.rank() else 0)")
    assert result.error["evalue"] == "rank 1 failed: SystemExit: the cell called sys.exit(3)"


def test_timeout_stops_late_ranks_and_shows_where_they_were_each_place_once(kernel):
    kernel.execute("import time\ndef wait_for_data():\n    time.sleep(60)\n").ok()
    result = kernel.execute("#pragma taas --gpus 2 --timeout 1.5\n" + RUN_ID + "wait_for_data()\n", timeout=30)
    assert result.error["ename"] == "RunTimedOut"
    assert result.error["evalue"] == "--timeout 1.5 s elapsed: ranks 0-1 still running, now stopped"
    assert result.seconds < 8
    tb = result.traceback
    assert "where the processes were when the time ran out:\nranks 0-1: in no collective:\n" in tb, tb
    assert tb.count("time.sleep(60)") == 1, "one place, shown once for both ranks"
    assert re.search(
        r"Cell In\[\d+\], line 3 in wait_for_data\n +time.sleep\(60\)\n +Cell In\[\d+\], line 3 in <module>"
        r"\n +wait_for_data\(\)",
        tb,
    ), "innermost frame first, each with its line"
    assert "worker.py" not in tb and "taas-lifeline" not in tb, "only the user's frames"
    assert processes_of_run(run_id_of(result)) == []


def test_interrupt_reaches_every_rank_and_their_workers_and_the_next_cell_runs(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 2
"""
        + RUN_ID
        + SLOW_WORKERS
        + """import taas
try:
    time.sleep(100)
finally:
    print("cleanup ran in rank", taas.rank(), flush=True)
""",
        interrupt_after=3,
        timeout=30,
    )
    assert result.error is not None and result.error["ename"] in ("KeyboardInterrupt", "RunInterrupted")
    assert "KeyboardInterrupt" in result.traceback
    assert "[rank 0] cleanup ran in rank 0" in result.each_rank()
    assert "[rank 1] cleanup ran in rank 1" in result.each_rank()
    assert result.seconds < 10
    assert processes_of_run(run_id_of(result)) == []
    assert kernel.execute("#pragma taas --gpus 2\nprint('next')").ok().each_rank().count("next") == 2


def test_interrupt_escalates_to_sigkill_for_ranks_that_ignore_signals(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 2
"""
        + RUN_ID
        + """import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(100)
""",
        interrupt_after=2,
        timeout=30,
    )
    assert result.error is not None
    assert 7 < result.seconds < 12, "SIGTERM after 3 s, SIGKILL after 6 s"
    assert "SIGKILL" in result.traceback
    assert processes_of_run(run_id_of(result)) == []


def test_a_second_interrupt_skips_ahead(kernel):
    msg_id = kernel.client.execute("""#pragma taas --gpus 2
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
time.sleep(100)
""")
    time.sleep(2.5)
    kernel.manager.interrupt_kernel()
    time.sleep(0.5)
    started = time.monotonic()
    kernel.manager.interrupt_kernel()
    reply = kernel.client.get_shell_msg(timeout=20)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kernel.client.get_shell_msg(timeout=20)
    assert reply["content"]["status"] == "error"
    assert time.monotonic() - started < 2.5, "SIGTERM came at once instead of after 3 s"


def test_ranks_and_their_children_die_within_3_s_of_the_kernel(fresh_kernel):
    fresh_kernel.client.execute(
        "#pragma taas --gpus 2\n" + SLOW_WORKERS + "print('started', flush=True)\ntime.sleep(100)"
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(fresh_kernel.children()) < 6:
        time.sleep(0.1)
    family = fresh_kernel.children()
    assert len(family) >= 6, "2 ranks with 2 DataLoader workers each"
    family.append(fresh_kernel.fork_server())
    os.kill(fresh_kernel.pid, signal.SIGKILL)
    running = still_running(family, timeout=3)
    assert running == [], [p.cmdline() for p in running]


def test_nothing_is_left_in_temp_folders_or_shared_memory(tmp_path):
    from support.kernel import Kernel

    private = tmp_path / "tmp"
    private.mkdir()
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    kernel = Kernel({"TMPDIR": str(private)})  # everything the kernel, taas and the ranks make goes here
    try:
        kernel.execute(
            "#pragma taas --gpus 2\nimport torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()"
        ).ok()
        kernel.execute("#pragma taas --gpus 2\nraise ValueError('x')")
        kernel.execute("#pragma taas --gpus 2 --timeout 0.5\nimport time; time.sleep(9)")
        kernel.execute("#pragma taas --gpus 2 --start forkserver\nimport torch\nx = torch.ones(4)").ok()
        left = [p.name for p in private.iterdir() if str(kernel.pid) not in p.name]
    finally:
        kernel.shutdown()
    assert left == []
    shm_after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    ours = [name for name in shm_after - shm_before if name.startswith(("torch_", "taas", "psm_", "pymp"))]
    assert ours == []


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_rank_that_left_early_with_sys_exit_0_is_named_when_its_peer_then_fails(kernel, start):
    result = kernel.execute(
        f"""#pragma taas --gpus 2 --start {start}
import sys, time, torch, taas, torch.distributed as dist
dist.init_process_group("gloo")
if taas.rank() == 1:
    sys.exit(0)
time.sleep(0.5)
dist.all_reduce(torch.ones(1))  # rank 1 is gone: this fails
""",
        timeout=30,
    )
    assert result.error["evalue"].startswith("rank 0 failed: ")
    assert "before rank 0 failed: rank 1 exited early with sys.exit(0)" in result.traceback


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_rank_that_left_with_os_exit_0_is_named_when_a_peer_then_fails(kernel, start):
    result = kernel.execute(
        f"""#pragma taas --gpus 3 --start {start}
import os, time, torch, taas, torch.distributed as dist
dist.init_process_group("gloo")
if taas.rank() == 2:
    os._exit(0)  # no exception, no word to taas: status 0
time.sleep(0.5)
dist.all_reduce(torch.ones(1))  # rank 2 is gone: this fails
""",
        timeout=30,
    )
    assert result.error["evalue"].startswith(("rank 0 failed: ", "rank 1 failed: "))
    assert re.search(r"before rank [01] failed: rank 2 exited with code 0 before the cell finished", result.traceback)


def test_a_rank_that_left_early_is_named_when_the_others_time_out(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 2 --timeout 2
import sys, time, taas
if taas.rank() == 1:
    sys.exit()
time.sleep(30)  # waiting for rank 1, which will never come
""",
        timeout=30,
    )
    assert result.error["ename"] == "RunTimedOut"
    assert "before the time ran out: rank 1 exited early with sys.exit()" in result.traceback


def test_a_keyboard_interrupt_raised_by_the_cell_is_a_failure_with_its_traceback(kernel):
    result = kernel.execute(
        """#pragma taas --gpus 2
import taas
def give_up():
    raise KeyboardInterrupt("no more")
if taas.rank() == 1:
    give_up()
""",
        timeout=30,
    )
    assert result.error["evalue"] == "rank 1 failed: KeyboardInterrupt: no more"
    assert "rank 1's traceback:" in result.traceback
    assert 'raise KeyboardInterrupt("no more")' in result.traceback and "give_up()" in result.traceback


def test_error_values_carry_no_colour_codes(kernel):
    failed = kernel.execute("#pragma taas --gpus 1\nraise ValueError('\\x1b[31mred\\x1b[0m alert')")
    assert failed.error["evalue"] == "rank 0 failed: ValueError: red alert"
    interrupted = kernel.execute("#pragma taas --gpus 2\nimport time\ntime.sleep(30)", interrupt_after=1.5, timeout=30)
    assert interrupted.error["ename"] == "RunInterrupted"
    assert "\x1b" not in interrupted.error["evalue"]
    assert interrupted.error["evalue"].startswith("KeyboardInterrupt: taas run interrupted; every rank stopped")
    assert "\x1b[" in "".join(interrupted.error["traceback"]), "the lines the cell shows keep their colours"


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_tracebacks_quote_the_cell_header_as_written(kernel, start):
    result = kernel.execute(f"#!g2.8\n#pragma taas --gpus 2 --start {start}\nraise ValueError('top')\n", timeout=30)
    assert re.fullmatch(r"rank \d failed: ValueError: top", result.error["evalue"])
    tb = result.traceback
    assert re.search(r"1 #!g2\.8\n +2 #pragma taas --gpus 2 --start " + start + r"\n-+> 3 raise ValueError", tb), tb
    assert "%%taas" not in tb
    below_blanks = kernel.execute(
        f"\n\n#!g2.8\n#pragma taas --gpus 2 --start {start}\nraise ValueError('low')\n", timeout=30
    ).traceback  # blank lines above a header are allowed
    assert re.search(
        r"3 #!g2\.8\n +4 #pragma taas --gpus 2 --start " + start + r"\n-+> 5 raise ValueError", below_blanks
    ), below_blanks
    assert "%%taas" not in below_blanks


@pytest.mark.parametrize("call", ["torch.ones(2).cuda()", "torch.zeros(1, device='cuda')"])
def test_cuda_on_a_cpu_run_fails_with_a_hint_to_use_taas_device(kernel, call):
    result = kernel.execute(f"#pragma taas --gpus 1 --device cpu\nimport torch\nx = {call}\n", timeout=30)
    assert result.error["ename"] == "RankFailed"
    assert "this run is on CPU (--device cpu), so CUDA is not available in its ranks: taas.device()" in result.traceback
    other = kernel.execute("#pragma taas --gpus 1 --device cpu\nraise RuntimeError('not about CUDA')")
    assert "taas.device()" not in other.traceback


def test_a_taas_cell_is_named_by_the_number_the_notebook_shows(kernel):
    plain = kernel.execute("1/0")
    number = int(re.search(r"Cell In\[(\d+)\], line 1", plain.traceback)[1])
    result = kernel.execute("#pragma taas --gpus 2\n1/0")
    assert f"Cell In[{number + 1}], line 2" in result.traceback, result.traceback
