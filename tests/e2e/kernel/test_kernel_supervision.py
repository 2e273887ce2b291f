"""Every run is contained: an interrupt at any moment, processes that try to escape, a dying fork
server, and what a run opens to the network. Each test attacks the run the way a user's cell can.
"""

from __future__ import annotations

import errno
import json
import re
import time

import psutil
import pytest
from support.kernel import processes_of_run

WARM_FORK_SERVER = True  # interrupts that land while a warm server starts the ranks (tests/e2e/conftest.py)
MOSTLY_WAITS = True  # for the moment to interrupt, and for processes to be gone (tests/conftest.py)

STARTS = ["fork", "forkserver"]


def wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [
            pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        ]
        time.sleep(0.05)
    return alive


# -- 1. no interrupt can leave anything of a run for the next cell ------------------------------------
@pytest.mark.parametrize("start", STARTS)
def test_an_interrupt_at_any_moment_leaves_nothing_for_the_next_cell(kernel, start):
    # Unpickling `slow` takes a while in the fork server: interrupts land while the ranks are being started.
    kernel.execute("slow = [str(i) for i in range(1_500_000)]").ok()
    for n, delay in enumerate((0.02, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)):
        old = kernel.execute(
            f"""#pragma taas --gpus 2 --start {start}
import os, time
print("OLD{n}", os.environ["TAAS_RUN_ID"], len(slow), flush=True)
time.sleep(1.5)
old_name_{n} = 1
print("OLD{n} done", flush=True)
""",
            interrupt_after=delay,
            timeout=60,
        )
        run_ids = re.findall(r"OLD\d (taas-\w+)", old.stdout)
        new = kernel.execute(f"#pragma taas --gpus 2 --start {start} --output rank0\nprint('NEW{n}')").ok()
        assert new.stdout == f"NEW{n}\n", f"after an interrupt at {delay} s: {new.stdout!r}"
        assert kernel.value(f"'old_name_{n}' in globals()") is False, (
            f"the cell interrupted at {delay} s ended after {old.seconds:.2f} s with "
            f"{old.error and old.error['ename']}: {old.stdout!r}"
        )
        for run_id in set(run_ids):
            assert processes_of_run(run_id) == []
    kernel.execute("del slow").ok()


def test_an_interrupt_while_the_first_cell_imports_torch_stops_it_and_leaves_torch_whole(bare_kernel):
    """The first taas cell of a kernel that has not imported torch imports it, for a second or two. An
    interrupt then stops the cell once the import is whole: cut short, torch would stay half-imported,
    and the next ``import torch`` would crash the kernel or swallow the interrupt."""
    assert bare_kernel.value("'torch' in sys.modules") is False
    result = bare_kernel.execute("#pragma taas --gpus 2 --start fork\nlate_name = 1", interrupt_after=0.15, timeout=60)
    assert result.error is not None and result.error["ename"] == "KeyboardInterrupt", result.error
    assert bare_kernel.value("('torch' in sys.modules, 'late_name' in globals())") == (True, False), (
        "the interrupt came while torch was imported, and waited for the import's end"
    )
    assert bare_kernel.execute("import torch\nprint(torch.ones(3).sum().item())").ok().stdout == "3.0\n"
    next_cell = "#pragma taas --gpus 2 --start fork --output rank0\nprint('next')"
    assert bare_kernel.execute(next_cell).ok().stdout == "next\n"


def test_taas_cluster_looks_at_the_address_without_importing_ray_into_the_kernel(bare_kernel):
    """Ray's driver, its import and its threads are the cluster driver's, a process of taas's own: the kernel
    looks at an address (the form, a token Ray would need, something answering) without Ray."""
    pytest.importorskip("ray")
    refused = bare_kernel.execute("%taas cluster 127.0.0.1:9", timeout=60)
    assert refused.error["ename"] == "TaasUsageError" and "nothing answers at 127.0.0.1:9" in refused.error["evalue"]
    assert refused.seconds < 5, refused.seconds
    assert bare_kernel.value("'ray' in sys.modules") is False


@pytest.mark.timing
def test_an_interrupt_that_lands_in_fork_callbacks_or_while_ranks_start_stops_the_run_at_once(kernel):
    """At-fork callbacks (logging registers some) run Python inside os.fork: an interrupt raised
    there is swallowed, in the kernel (the cell then ran on to its end) or in a starting rank
    (which ignored it until the SIGTERM step). Here the callbacks sleep, so interrupts land in them."""
    # The callbacks are inherited by the supervisor, which forks the ranks: the parent's sleeps in the kernel
    # only, or the supervisor would take 1 s per rank to start them, and to hear the kernel's stop (2.3 s).
    kernel.execute(
        "import os, time\nSLOW_FORK = None\nKERNEL_PID = os.getpid()\nos.register_at_fork("
        "after_in_parent=lambda: time.sleep(1) if SLOW_FORK == 'parent' and os.getpid() == KERNEL_PID else None, "
        "after_in_child=lambda: time.sleep(1) if SLOW_FORK == 'child' else None)"
    ).ok()
    # parent: the kernel's fork of the supervisor; child: the supervisor's forks of the ranks, 1 s after it
    for where, delay in (("parent", 0.5), ("child", 1.6)):
        kernel.execute(f"SLOW_FORK = {where!r}").ok()
        try:
            result = kernel.execute(
                "#pragma taas --gpus 2 --start fork\nimport time\ntime.sleep(8)\nlate_name = 1",
                interrupt_after=delay,
                timeout=30,
            )
        finally:
            kernel.execute("SLOW_FORK = None").ok()
        assert result.error is not None and "Interrupt" in result.error["ename"], (where, result.stdout, result.stderr)
        assert result.seconds < delay + 2.0, f"interrupted in the {where}'s fork callbacks: {result.seconds:.1f} s"
        assert kernel.value("'late_name' in globals()") is False
    assert kernel.execute("#pragma taas --gpus 2 --start fork --output rank0\nprint('next')").ok().stdout == "next\n"


def _status(process: psutil.Process) -> str:
    try:
        return process.status()
    except psutil.NoSuchProcess:
        return "gone"


def test_a_second_interrupt_while_the_first_is_handled_leaves_no_zombie_descriptor_or_port(kernel):
    """The second interrupt lands while the run is being freed (waiting for its supervisor):
    the supervisor is still reaped, its channel and pidfd closed, the store's port closed."""
    cell = "#pragma taas --gpus 2 --start fork\nimport time\ntime.sleep(3)"
    kernel.execute(cell, interrupt_after=(0.1, 0.12), timeout=60)  # what the kernel opens once, on a first interrupt
    kernel.execute("#pragma taas --gpus 2 --start fork\nwarm = 1").ok()
    kernel_process = psutil.Process(kernel.pid)
    descriptors = kernel_process.num_fds()

    def listening() -> set:
        return {c.laddr for c in kernel_process.net_connections() if c.status == psutil.CONN_LISTEN}

    ports = listening()  # the kernel's own (ZeroMQ)
    server = kernel.fork_server()
    assert server is not None

    def supervisors() -> list[str]:
        """The kernel's children but its fork server, running or dead and unreaped: none once a run is freed.
        Zombies alone would not do: a supervisor let go is one for the moment between its exit and its
        reaping (by a thread of the kernel's), which a second look may catch after a first saw it alive."""
        return [f"{c.pid} {_status(c)}" for c in kernel_process.children() if c.pid != server.pid]

    for first in (0.01, 0.02, 0.03, 0.02, 0.04, 0.08):
        kernel.execute(cell, interrupt_after=(first, first + 0.02), timeout=60)
        kernel.execute("#pragma taas --gpus 2 --start fork --output rank0\nprint('next')").ok()
        deadline = time.monotonic() + 10  # a supervisor let go exits, and a thread reaps it, as the next cell runs
        while time.monotonic() < deadline and (supervisors() or kernel_process.num_fds() != descriptors):
            time.sleep(0.05)
        assert supervisors() == [], f"after interrupts at {first} s"
        assert kernel_process.num_fds() == descriptors, f"after interrupts at {first} s"
        assert listening() == ports


@pytest.mark.parametrize("start", STARTS)
def test_an_interrupt_while_ranks_print_heavily_leaves_the_start_method_working(kernel, start):
    # Lines of 200 characters: the ranks print tens of thousands a second, more than the kernel relays. At 5000
    # a line they printed 50 MB before the interrupt ended them, which this test's client then took over a
    # minute to read on a loaded machine (3 of 24 runs beside 2 other kernels and 4 busy processes; the
    # kernel idle all along); at 200, 8-14 MB, read in 4-8 s in 18 runs out of 18 alike.
    kernel.execute(
        f"""#pragma taas --gpus 2 --start {start}
import sys
line = "x" * 200
while True:
    print(line)
""",
        interrupt_after=1.5,
        timeout=60,
    )
    for n in range(3):
        result = kernel.execute(f"#pragma taas --gpus 2 --start {start} --output rank0\nprint('fine {n}')").ok()
        assert result.stdout == f"fine {n}\n"


def test_the_fork_server_dying_during_a_run_is_an_error_within_10_s_and_the_next_cell_works(fresh_kernel):
    fresh_kernel.execute("#pragma taas --gpus 1 --start forkserver\nx = 1").ok()
    server = fresh_kernel.fork_server()
    msg_id = fresh_kernel.client.execute("""#pragma taas --gpus 2 --start forkserver
import os, subprocess, time
# a descendant that holds every descriptor the rank holds, in a session of its own
subprocess.Popen(["sleep", "60"], start_new_session=True, close_fds=False)
print("PIDS", os.getpid(), flush=True)
time.sleep(60)
""")
    pids = []
    deadline = time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < deadline:
        message = fresh_kernel.client.get_iopub_msg(timeout=30)
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            pids += [int(p) for p in re.findall(r"PIDS (\d+)", message["content"]["text"])]
    family = [p.pid for p in psutil.Process(pids[0]).parent().children(recursive=True)]
    server.kill()
    killed = time.monotonic()
    error = None
    while time.monotonic() - killed < 15:
        message = fresh_kernel.client.get_iopub_msg(timeout=15)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "error":
            error = message["content"]
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            break
    assert time.monotonic() - killed < 10
    assert error is not None and "fork server" in error["evalue"] and "SIGKILL" in error["evalue"], error
    assert wait_gone(family) == []
    assert (
        fresh_kernel.execute("#pragma taas --gpus 2 --start forkserver --output rank0\nprint('next')").ok().stdout
        == "next\n"
    )


# -- 2. nothing a rank starts outlives its run ---------------------------------------------------------
ESCAPE = """#pragma taas --gpus 2 --start {start} {options}
import os, subprocess, time
pids = [subprocess.Popen(["sleep", "60"], start_new_session=True).pid]
read_end, write_end = os.pipe()
if os.fork() == 0:  # a daemon that never execs: fork, setsid, fork, parent exits
    os.setsid()
    if os.fork() == 0:
        os.write(write_end, str(os.getpid()).encode())
        time.sleep(60)
    os._exit(0)
pids.append(int(os.read(read_end, 32)))
print("ESCAPED", " ".join(map(str, pids)), flush=True)
{ending}
"""


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize(
    "options, ending, interrupt",
    [
        ("", "", None),
        ("--timeout 2", "time.sleep(60)", None),
        ("", "time.sleep(60)", 2.5),
        (
            "",
            "time.sleep(0.5)  # both ranks have escaped before either fails\nraise ValueError('after escaping')",
            None,
        ),
        ("", "time.sleep(0.5)\nos.kill(os.getpid(), 9)", None),
    ],
)
def test_no_escaped_process_outlives_its_run(kernel, start, options, ending, interrupt):
    result = kernel.execute(
        ESCAPE.format(start=start, options=options, ending=ending), interrupt_after=interrupt, timeout=60
    )
    escaped = [int(pid) for line in re.findall(r"ESCAPED ([\d ]+)", result.stdout) for pid in line.split()]
    assert len(escaped) == 4, result.stdout
    assert wait_gone(escaped) == [], "each run's processes are gone within 10 s of its end"


@pytest.mark.parametrize("ending", ["", "if taas.rank() == 1:\n    time.sleep(0.3)\n    os.kill(os.getpid(), 9)"])
@pytest.mark.timing
def test_a_background_process_holding_a_ranks_output_does_not_delay_the_cells_end(kernel, ending):
    result = kernel.execute(f"""#pragma taas --gpus 2
import os, subprocess, taas, time
subprocess.Popen(["sleep", "30"], start_new_session=True)  # holds the rank's stdout and stderr
print("started", flush=True)
{ending}
""")
    assert result.each_rank().count("started") == 2
    assert result.seconds < 2.0, f"the cell took {result.seconds:.2f} s"


@pytest.mark.parametrize("start", STARTS)
def test_a_rank_that_joins_the_kernels_group_and_ignores_signals_is_still_stopped(kernel, start):
    cell = f"""#pragma taas --gpus 2 --start {start} {{options}}
import os, signal, time
try:
    os.setpgid(0, os.getpgid({kernel.pid}))
except PermissionError:
    pass  # ranks of the fork server live in another session
for name in ("SIGINT", "SIGTERM"):
    signal.signal(getattr(signal, name), signal.SIG_IGN)
print("JOINED", flush=True)
time.sleep(60)
"""
    began = time.monotonic()
    result = kernel.execute(cell.format(options=""), interrupt_after=2.0, timeout=40)
    assert "KeyboardInterrupt" in result.traceback and time.monotonic() - began < 15
    began = time.monotonic()
    result = kernel.execute(cell.format(options="--timeout 2"), timeout=40)
    assert result.error["ename"] == "RunTimedOut" and time.monotonic() - began < 15
    assert kernel.execute("print('kernel fine')").ok().stdout == "kernel fine\n"


SOCKETS = """
import os, socket, stat, struct, json, psutil
def peer(fd):
    # the process at the other end of a local socket, as the system knows it
    with socket.socket(fileno=os.dup(fd)) as s:
        return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
def sockets():
    numbers = [fd for fd in map(int, os.listdir("/proc/self/fd"))
               if os.path.exists(f"/proc/self/fd/{fd}") and stat.S_ISSOCK(os.fstat(fd).st_mode)]
    ends = [[c.laddr.port if c.laddr else None, c.raddr.port if c.raddr else None]
            for c in psutil.Process().net_connections("inet")]
    return {"count": len(numbers), "ends": ends, "peers": [peer(fd) for fd in numbers], "parent": os.getppid()}
"""


@pytest.mark.parametrize("start", STARTS)
def test_ranks_and_their_daemons_hold_no_socket_they_do_not_need(kernel, start):
    connection = json.loads(open(kernel.manager.connection_file).read())
    kernel_ports = {connection[name] for name in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")}
    result = kernel.execute(f"""#pragma taas --gpus 2 --start {start}
{SOCKETS}
read_end, write_end = os.pipe()
if os.fork() == 0:  # a daemon that never execs
    os.setsid()
    os.write(write_end, json.dumps(sockets()).encode())
    os._exit(0)
print("SOCKETS", json.dumps(sockets()), os.environ["MASTER_PORT"], os.read(read_end, 4096).decode())
""").ok()
    seen = {
        int(rank): (json.loads(mine), int(port), json.loads(daemon))
        for rank, mine, port, daemon in re.findall(r"\[rank (\d)\] SOCKETS (\{.*?\}) (\d+) (\{.*\})", result.stdout)
    }
    assert sorted(seen) == [0, 1], result.stdout
    for rank, (mine, port, daemon) in seen.items():
        for found in (mine, daemon):
            ports = {p for end in found["ends"] for p in end}
            assert not ports & kernel_ports
            assert all(port in end for end in found["ends"]), "the run's store is the only network socket"
    for rank in (0, 1):
        mine = seen[rank][0]
        assert mine["count"] == 1 and mine["peers"] == [mine["parent"]], (
            "before it joins the process group, a rank holds one socket: its channel with its supervisor"
        )


DESCRIPTORS = """
import os
def descriptors():
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own descriptor
    return found
"""


@pytest.mark.parametrize("start", STARTS)
def test_ranks_hold_none_of_the_kernels_machinery_but_keep_what_the_notebook_opened(kernel, start, tmp_path):
    """Dropped: the kernel's sockets, event and poll descriptors, output pipes, memory files, history
    database and saved stdout/stderr. Kept, in forked ranks: a file, a pipe and a multiprocessing
    queue that an earlier cell made."""
    notes = tmp_path / "notes.txt"
    kernel.execute(
        DESCRIPTORS + f"import multiprocessing\nnotes = open({str(notes)!r}, 'w')\n"
        "read_end, write_end = os.pipe()\nqueue = multiprocessing.Queue()\n"
        "memory = os.memfd_create('cells')\nos.write(memory, b'data')\nKERNEL = descriptors()"
    ).ok()
    kernel_fds = {
        int(fd): target for fd, target in json.loads(kernel.value("__import__('json').dumps(KERNEL)")).items()
    }
    history = {target for target in kernel_fds.values() if target.endswith("history.sqlite")}
    originals = set(
        kernel.value(
            "[KERNEL[fd] for fd in (getattr(s, '_original_stdstream_copy', None) "
            "for s in (__import__('sys').stdout, __import__('sys').stderr)) if fd is not None]"
        )
    )
    output_pipes = {kernel_fds[fd] for fd in (1, 2) if kernel_fds[fd].startswith("pipe:")}
    machinery = {target for target in kernel_fds.values() if target.startswith(("socket:", "/memfd:"))}
    assert history and machinery
    uses_them = (
        (
            "notes.write('rank'); notes.flush()\nos.write(write_end, b'pipe ')\n"
            "queue.put(int(os.environ['RANK'])); queue.close(); queue.join_thread()\n"
            "try:\n    os.pread(memory, 4, 0)\nexcept OSError as e:\n    print('MEMORY', e.errno)"
        )
        if start == "fork"
        else ""
    )
    result = kernel.execute(f"""#pragma taas --gpus 2 --start {start}
import json, os
print("FDS", json.dumps(descriptors()))
{uses_them}
""").ok()
    seen = re.findall(r"FDS (\{.*\})", result.stdout)
    assert len(seen) == 2, result.stdout
    for found in map(json.loads, seen):
        targets = set(found.values())
        assert not targets & machinery, "the kernel's sockets or memory files"
        assert not targets & output_pipes, "the pipes that capture the kernel's output"
        assert not [t for t in targets if t.startswith("anon_inode:")], "the kernel's event and poll descriptors"
        assert not targets & history, "the kernel's history database"
        assert not targets & originals, "ipykernel's copies of the kernel's own stdout and stderr"
    if start == "fork":
        kernel.execute("notes.close()").ok()
        assert notes.read_text() == "rankrank", "a file the notebook opened is still the ranks' to use"
        assert kernel.value("os.read(read_end, 100)") == b"pipe pipe "
        assert sorted(kernel.value("[queue.get(timeout=10) for _ in range(2)]")) == [0, 1]
        assert result.each_rank().count(f"MEMORY {errno.EBADF}") == 2, (
            "a dropped descriptor fails loudly, never reads as empty"
        )
    kernel.execute("os.close(read_end); os.close(write_end); os.close(memory); queue.close()").ok()


# -- 3. only this machine can talk to a run --------------------------------------------------------------
@pytest.mark.parametrize("start", STARTS)
def test_every_socket_a_run_listens_on_is_on_loopback(kernel, start):
    kernel.execute("import os\nKERNEL_PID = os.getpid()").ok()
    result = kernel.execute(f"""#pragma taas --gpus 2 --start {start}
import json, os, psutil, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
dist.barrier()
def listening(process):
    return sorted({{(c.laddr.ip, c.laddr.port) for c in process.net_connections("inet") if c.status == "LISTEN"}})
found = [listening(psutil.Process()), listening(psutil.Process(os.getppid())), listening(psutil.Process(KERNEL_PID))]
print("LISTENING", os.environ["MASTER_PORT"], json.dumps(found))
dist.barrier()
dist.destroy_process_group()
""").ok()
    found = [
        (int(port), json.loads(data)) for port, data in re.findall(r"\[rank \d\] LISTENING (\d+) (.*)", result.stdout)
    ]
    assert len(found) == 2
    for port, (rank, supervisor, kernel_side) in found:
        assert {ip for ip, _ in rank + supervisor + kernel_side} <= {"127.0.0.1", "::1"}, (
            rank,
            supervisor,
            kernel_side,
        )
        assert supervisor == [], "the supervisor listens on nothing"
        assert ["127.0.0.1", port] in kernel_side, "the kernel serves the run's store on loopback"
    after = (
        kernel.execute(
            "import psutil\nprint(sorted({c.laddr.port for c in psutil.Process().net_connections('inet') "
            "if c.status == 'LISTEN'}))"
        )
        .ok()
        .stdout
    )
    assert str(found[0][0]) not in after, "the store's port is closed with the run"
