"""How long a trivial distributed job takes to launch: taas cells against what a user would use instead.

The job, in every rank: ``init_process_group("gloo")`` (env://), one ``all_reduce`` of a small
tensor, ``barrier()``, ``destroy_process_group()``, exit. At 2 and 4 ranks, on CPU.

Contenders, all in one run on one machine:
  fork        a taas cell, ``--start fork`` (ranks forked from the kernel)
  forkserver  a taas cell, ``--start forkserver`` (ranks forked from the fork server, names shipped by value)
  bare        ``bare_launch(job, N)``: a 20-line launcher defined in the kernel, as a user would write
              it: a free loopback port, one ``os.fork()`` per rank, torchrun's variables set in each
              child, the same threads per rank as taas gives (cores // ranks), ``os._exit``, wait
              for all. The floor: the ranks' own work and nothing else
  accelerate  ``accelerate.notebook_launcher(job, num_processes=N)`` in a cell of the same kind of kernel
  torchrun    ``torchrun --standalone --nproc-per-node N job.py`` as a subprocess (outside a notebook)

How time is measured. For the notebook contenders: from the kernel's ``busy`` status to its
``idle`` status for the cell, both stamped by the kernel itself on iopub. That is what the user
waits for, with the same IPython overhead for every contender and without the client's own
latency. The client's round trip (execute request sent to idle seen) is kept too, under keys
ending in "client": it is what the comparison with the bare launcher is judged on, as a user
measures it, and it would show work a launcher does after the kernel says idle (before the
next cell can start). The accelerate cell also times ``notebook_launcher`` with
``time.perf_counter()`` inside the cell (kept in the JSON, to show that overhead is small). For
torchrun: the subprocess's wall time. Every figure is a median: the machine is shared and noisy.

Cold and warm. Every kernel has imported torch before it is measured. "cold": the first launch
in a fresh kernel, one fresh kernel per sample; for fork with the fork server already idle, for
forkserver right after ``%load_ext`` (so it includes waiting for the fork server to import torch).
"warm": later launches, after one unmeasured launch of each contender at each size, with a
pause between cells as a user re-running a cell would leave. Forkserver and Accelerate each run in a
kernel of their own (no other launcher's leftovers); fork and bare take turns in one kernel, so
that they are compared in the same kernel (the bare launcher leaves nothing behind). All warm
kernels stay open and take turns, so the machine's noise falls on all alike. The same cells run
back-to-back in one kernel are reported too (light kernels only): background work of one launch
(the fork server's clean-up, say) can delay the next. torchrun starts fresh interpreters every
time, so it is reported once.

Light and heavy kernels. The warm series run twice: in light kernels, which hold torch and the
contender's setup only, and in heavy kernels, which have also imported Lightning and bound
20,000 plain names and 20,000 small tensors in the notebook's namespace, as a working notebook
would. A launcher whose cost grows with what the kernel holds shows it there. Cold figures,
back-to-back series, torchrun and shipping are measured in light kernels only.

A launch that does not finish in HANG_SECONDS is counted as hung, left out of the medians, and
its kernel replaced; the count is printed.

Shipping: a 512 MiB tensor defined in an earlier cell, read by a 2-rank forkserver cell; the
effective rate is 512 MiB / (that cell's time - the trivial forkserver cell's time), both medians
from the same kernel, interleaved. Memory is sampled while the ranks hold the tensor, against
the same cell holding a 16-element tensor: kernel, fork server and ranks together should hold
at most one copy more than the kernel already did (the shared memory file the ranks map).

Targets are printed as PASS/FAIL lines, never asserted: this is a measurement, not a test.
Among them: taas fork within BARE_TARGET of the bare launcher at 4 ranks, in the light and in the
heavy kernel (warm, client round trip, medians of ``warm_rounds``).
Figures go to benchmarks/results/launch.json, the plot to docs/images/launch.png (left: every
contender, cold and warm, light kernel; right: warm cells against the bare launcher, light and
heavy kernels).

Kernels inherit this process's environment: run it with ``PYTHONPATH=src`` (or an installed
copy) and every kernel is checked to import taas_magic from the same file as the benchmark.

    python benchmarks/launch.py            # about 4 minutes on 2 cores (20 s more for each hung launch)
    python benchmarks/launch.py --quick    # fewer repetitions: about 2 minutes on a quiet machine
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence, TypeVar

import psutil
from harness import (
    BENCH_ENV,
    ROOT,
    BenchError,
    Cell,
    Hung,
    Kernel,
    Progress,
    arguments,
    machine_info,
    print_checks,
    shown,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes

T = TypeVar("T")
RESULTS = ROOT / "benchmarks" / "results" / "launch.json"
PLOT = ROOT / "docs" / "images" / "launch.png"
RANKS = (2, 4)
PAUSE_SECONDS = 0.5  # between warm cells: a person re-running a cell is slower than a loop
BIG_NUMEL = 128 * 2**20  # float32: 512 MiB
BIG_BYTES = BIG_NUMEL * 4
READY_MARKER = "taas-bench-ranks-ready"
HOLD_SECONDS = 1.5  # how long the ranks keep the shipped tensor while memory is sampled
HANG_SECONDS = 20.0  # a trivial launch takes well under a second here: one this late is stuck
MAX_KERNELS_PER_SERIES = 4
COPY_TOLERANCE = 0.10  # of the tensor's size: sampling noise, the ranks' own small allocations

JOB = textwrap.dedent("""\
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t[0].item() == dist.get_world_size(), t
    dist.barrier()
    dist.destroy_process_group()
""")

TAAS_SETUP = "%load_ext taas_magic\nimport torch, torch.distributed, time"
ACCELERATE_SETUP = (
    "import torch, torch.distributed, time\nfrom accelerate import notebook_launcher\n"
    "def job():\n" + textwrap.indent(JOB, "    ")
)
# What a user would write instead of taas: torchrun's variables by hand, one os.fork() per rank,
# the same threads per rank as taas gives (cores // ranks). It leaves nothing behind, so its
# cells can take turns with taas cells in one kernel.
BARE_SETUP = (
    textwrap.dedent("""\
    import os, socket, traceback, torch

    def bare_launch(job, ranks):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        threads = max(1, len(os.sched_getaffinity(0)) // ranks)
        children = []
        for rank in range(ranks):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
                    torch.set_num_threads(threads)
                    job()
                    code = 0
                except BaseException:
                    os.write(2, traceback.format_exc().encode())
                finally:
                    os._exit(code)
            children.append(pid)
        failed = [pid for pid in children if os.waitpid(pid, 0)[1] != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} of {ranks} ranks failed")
""")
    + "def bare_job():\n"
    + textwrap.indent(JOB, "    ")
)
# A kernel as a working notebook leaves it: Lightning imported, many names and tensors bound.
HEAVY_NAMES = 20_000
HEAVY_SETUP = textwrap.dedent(f"""\
    import pytorch_lightning
    for _i in range({HEAVY_NAMES}):
        globals()[f"name_{{_i}}"] = _i
        globals()[f"tensor_{{_i}}"] = torch.ones(4)
    del _i
""")


@dataclass(frozen=True)
class Settings:
    cold_kernels: int  # fresh kernels per contender and rank count
    warm_rounds: int  # paced launches per contender, rank count and kernel, the kernels taking turns
    back_to_back_rounds: int  # launches per contender and rank count, each kernel alone, no pause
    torchrun_runs: int
    shipping_rounds: int


FULL = Settings(cold_kernels=3, warm_rounds=9, back_to_back_rounds=7, torchrun_runs=3, shipping_rounds=5)
QUICK = Settings(cold_kernels=1, warm_rounds=3, back_to_back_rounds=3, torchrun_runs=1, shipping_rounds=2)


Samples = dict[str, dict[int, list[float]]]  # "fork/warm", "fork/warm heavy client" -> ranks -> seconds


@dataclass
class Tally:
    """Everything measured, and everything that went wrong while measuring."""

    samples: Samples = field(default_factory=dict)
    launches: dict[str, int] = field(default_factory=dict)  # contender -> launches tried, measured or not
    hangs: dict[str, dict[int, int]] = field(default_factory=dict)  # contender -> ranks -> launches that hung
    left_behind: list[str] = field(default_factory=list)  # processes alive after a normal kernel shutdown
    left_after_hang: list[str] = field(default_factory=list)  # ... after killing a kernel stuck in a launch

    def add(self, key: str, ranks: int, seconds: float) -> None:
        self.samples.setdefault(key, {}).setdefault(ranks, []).append(seconds)

    def tried(self, contender: str) -> None:
        self.launches[contender] = self.launches.get(contender, 0) + 1

    def hung(self, contender: str, ranks: int) -> None:
        by_ranks = self.hangs.setdefault(contender, {})
        by_ranks[ranks] = by_ranks.get(ranks, 0) + 1


# -- a real kernel, as a notebook drives it ----------------------------------------------------
class fresh_kernel:
    """A kernel that has run ``setup``, shut down on the way out whatever happens."""

    def __init__(self, tally: Tally, setup: str, wait_for_fork_server: bool = False):
        self.tally = tally
        self.setup = setup
        self.wait_for_fork_server = wait_for_fork_server

    def __enter__(self) -> Kernel:
        self.kernel = Kernel(grace=5)
        try:
            self.kernel.run(self.setup, timeout=300)
            if "%load_ext taas_magic" in self.setup:
                self.kernel.check_module("taas_magic")
            if self.wait_for_fork_server:
                self.kernel.wait_fork_server_idle()
        except BaseException:
            self.__exit__()
            raise
        return self.kernel

    def __exit__(self, *exc: object) -> None:
        left = self.kernel.shutdown()
        (self.tally.left_after_hang if self.kernel.hung else self.tally.left_behind).extend(left)


# -- the contenders in a notebook --------------------------------------------------------------
def taas_cell(start: str, ranks: int, body: str = JOB) -> str:
    return f"#pragma taas --gpus {ranks} --device cpu --start {start} --output rank0 --return none\n{body}"


def bare_cell(ranks: int) -> str:
    return f"bare_launch(bare_job, {ranks})"


def accelerate_cell(ranks: int) -> str:
    """A fresh port every time, as a careful user would pass; Accelerate's default is a fixed 29500."""
    return (
        f"_t0 = time.perf_counter()\nnotebook_launcher(job, num_processes={ranks}, use_port='{fresh_port()}')\n"
        "print('taas-bench-inside', time.perf_counter() - _t0)"
    )


@dataclass(frozen=True)
class Contender:
    name: str
    setup: str
    cell: Callable[[int], str]
    taas: bool  # its kernel starts a fork server, which warm figures wait for: it competes for the cores
    cold_waits_for_server: bool  # fork: so its cold figure is the fork path's; forkserver: its cold figure includes it


FORK = Contender("fork", TAAS_SETUP, lambda ranks: taas_cell("fork", ranks), True, True)
FORKSERVER = Contender("forkserver", TAAS_SETUP, lambda ranks: taas_cell("forkserver", ranks), True, False)
ACCELERATE = Contender("accelerate", ACCELERATE_SETUP, accelerate_cell, False, False)
BARE = Contender("bare", BARE_SETUP, bare_cell, False, False)
NOTEBOOK_CONTENDERS = (FORK, FORKSERVER, ACCELERATE)


@dataclass(frozen=True)
class KernelKind:
    """What a kernel holds besides its contenders' setup; ``suffix`` marks its figures' keys."""

    name: str
    setup: str
    suffix: str
    label: str


LIGHT = KernelKind("light", "", "", "light kernel: torch only")
HEAVY = KernelKind(
    "heavy", HEAVY_SETUP, " heavy", f"heavy kernel: Lightning, {HEAVY_NAMES:,} names, {HEAVY_NAMES:,} tensors"
)
KINDS = (LIGHT, HEAVY)
# The warm kernels, kept open together: fork and bare take turns in one kernel, as the
# comparison asks ("in the same kernel"); forkserver and Accelerate each have one of their own.
WARM_KERNELS = tuple(
    (kind, contenders) for kind in KINDS for contenders in ((FORK, BARE), (FORKSERVER,), (ACCELERATE,))
)

_used_ports: set[int] = set()


def fresh_port() -> int:
    """A free loopback port never handed out before in this run, so no launch reuses another's."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _used_ports:
            _used_ports.add(port)
            return port


def inside_seconds(cell: Cell) -> float | None:
    for line in cell.stdout.splitlines():
        if line.startswith("taas-bench-inside"):
            return float(line.split()[1])
    return None


# -- measurements ------------------------------------------------------------------------------
def launch(tally: Tally, kernel: Kernel, contender: Contender, key: str, ranks: int, measured: bool = True) -> bool:
    """One launch; its time goes to ``key`` if measured. False if it hung (the kernel is then unusable)."""
    tally.tried(contender.name)
    try:
        cell = kernel.run(contender.cell(ranks), timeout=HANG_SECONDS)
    except Hung:
        tally.hung(contender.name, ranks)
        return False
    if measured:
        tally.add(key, ranks, cell.kernel_seconds)
        tally.add(f"{key} client", ranks, cell.client_seconds)
        inside = inside_seconds(cell)
        if inside is not None:
            tally.add(f"{key} inside cell", ranks, inside)
    return True


def measure_cold(settings: Settings, tally: Tally, progress: Callable[[str], None]) -> None:
    """The first launch in fresh kernels, one kernel per sample."""
    for index in range(settings.cold_kernels):
        for ranks in RANKS:
            for contender in NOTEBOOK_CONTENDERS:
                with fresh_kernel(tally, contender.setup, contender.cold_waits_for_server) as kernel:
                    launch(tally, kernel, contender, f"{contender.name}/cold", ranks)
        progress(f"cold kernels, round {index + 1}/{settings.cold_kernels}")


class WarmKernel:
    """A kernel for warm launches of some contenders, warmed up with one launch of each at each size.

    A launch that hangs takes its kernel with it: the next launch gets a fresh kernel, warmed
    up the same way, so the figures stay warm ones.
    """

    def __init__(self, tally: Tally, kind: KernelKind, contenders: tuple[Contender, ...]):
        self.tally = tally
        self.kind = kind
        self.contenders = contenders
        self.setup = "\n".join([contender.setup for contender in contenders] + [kind.setup])
        self.holder: fresh_kernel | None = None
        self.kernel: Kernel | None = None

    def start(self) -> None:
        waits = any(contender.taas for contender in self.contenders)
        for _ in range(MAX_KERNELS_PER_SERIES):
            self.holder = fresh_kernel(self.tally, self.setup, waits)
            self.kernel = self.holder.__enter__()
            if all(
                launch(self.tally, self.kernel, contender, "", n, measured=False)
                for contender in self.contenders
                for n in RANKS
            ):
                return
            self.close()
        names = "+".join(contender.name for contender in self.contenders)
        raise BenchError(f"{names} ({self.kind.name}): launches kept hanging in {MAX_KERNELS_PER_SERIES} fresh kernels")

    def launch(self, contender: Contender, phase: str, ranks: int) -> None:
        if self.kernel is None:
            self.start()
        assert self.kernel is not None
        if not launch(self.tally, self.kernel, contender, f"{contender.name}/{phase}{self.kind.suffix}", ranks):
            self.close()

    def close(self) -> None:
        if self.holder is not None:
            holder, self.holder, self.kernel = self.holder, None, None
            holder.__exit__()


def rotated(items: Sequence[T], by: int) -> list[T]:
    """The items, starting from the ``by``-th: a different one leads each round."""
    by %= len(items)
    return list(items[by:]) + list(items[:by])


def measure_warm(settings: Settings, tally: Tally, progress: Callable[[str], None]) -> None:
    """Later launches in light and heavy kernels, all kept open.

    Paced like a person, the kernels take turns (in a rotating order, and so do fork and bare
    within their kernel), so the machine's noise falls on all of them alike; back-to-back, each
    light kernel runs each of its contenders' series alone, as "run all cells" would.
    """
    kernels = [WarmKernel(tally, kind, contenders) for kind, contenders in WARM_KERNELS]
    try:
        for kernel in kernels:
            kernel.start()
        progress("warm kernels started")
        for round_ in range(settings.warm_rounds):
            for ranks in RANKS:
                for kernel in rotated(kernels, round_):
                    for contender in rotated(kernel.contenders, round_):
                        time.sleep(PAUSE_SECONDS)
                        kernel.launch(contender, "warm", ranks)
        progress("warm, paced")
        for kernel in kernels:
            for contender in kernel.contenders:
                if kernel.kind is LIGHT and contender in NOTEBOOK_CONTENDERS:
                    for _ in range(settings.back_to_back_rounds):
                        for ranks in RANKS:
                            kernel.launch(contender, "warm back-to-back", ranks)
        progress("warm, back-to-back")
    finally:
        for kernel in kernels:
            kernel.close()


def measure_torchrun(settings: Settings, tally: Tally, progress: Callable[[str], None]) -> None:
    with tempfile.TemporaryDirectory(prefix="taas-bench-") as folder:
        script = Path(folder) / "job.py"
        script.write_text(JOB)
        for _ in range(settings.torchrun_runs):
            for ranks in RANKS:
                try:
                    tally.add("torchrun/cold", ranks, run_torchrun(script, ranks))
                except Hung:
                    tally.hung("torchrun", ranks)
                tally.tried("torchrun")
    progress("torchrun")


def run_torchrun(script: Path, ranks: int, timeout: float = 6 * HANG_SECONDS) -> float:
    """Wall time of one torchrun; its whole session is killed if it overruns, so no worker survives."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", f"--nproc-per-node={ranks}", str(script)]
    env = {**os.environ, **BENCH_ENV, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    started = time.perf_counter()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Hung(f"torchrun did not finish in {timeout} s") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    seconds = time.perf_counter() - started
    if process.returncode != 0:
        raise BenchError(f"torchrun failed ({process.returncode}):\n{output.decode(errors='replace')}")
    return seconds


# -- shipping a big tensor ---------------------------------------------------------------------
SHIP_BODY = JOB.replace(
    "dist.barrier()",
    "total = float(big.sum())\nassert abs(total - big.numel()) < 1e-3 * big.numel(), total\ndist.barrier()",
)
HOLD_BODY = textwrap.dedent(f"""\
    import time, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    total = float(held.sum())
    dist.barrier()
    if dist.get_rank() == 0:
        print({READY_MARKER!r}, flush=True)
    time.sleep({HOLD_SECONDS})
    dist.barrier()
    dist.destroy_process_group()
""")
PACK_CELL = textwrap.dedent("""\
    from taas_magic.wire import shipping as _shipping
    _t0 = time.perf_counter()
    _shipment = _shipping.pack(globals(), ["big"])
    print("taas-bench-inside", time.perf_counter() - _t0)
    _shipment.close()
    del _shipment
""")


def pss(pid: int) -> int:
    """Proportional set size in bytes: shared pages divided among the processes that map them."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise BenchError(f"no Pss in /proc/{pid}/smaps_rollup")


def shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class MemorySample:
    kernel_pss: int = 0
    kernel_rss: int = 0
    server_pss: int = 0
    server_rss: int = 0
    ranks_pss: int = 0
    ranks_rss: int = 0
    ranks: int = 0
    shmem: int = 0

    @property
    def total_pss(self) -> int:
        return self.kernel_pss + self.server_pss + self.ranks_pss


def sample_memory(kernel: Kernel) -> MemorySample:
    server = kernel.fork_server()
    sample = MemorySample(
        kernel_pss=pss(kernel.pid), kernel_rss=psutil.Process(kernel.pid).memory_info().rss, shmem=shmem()
    )
    if server is not None:
        sample.server_pss, sample.server_rss = pss(server.pid), server.memory_info().rss
        for rank in server.children(recursive=True):
            sample.ranks_pss += pss(rank.pid)
            sample.ranks_rss += rank.memory_info().rss
            sample.ranks += 1
    return sample


def memory_while_held(kernel: Kernel, name: str) -> MemorySample:
    """Run a 2-rank forkserver cell that holds ``name``; sample memory once every rank has read all of it."""
    taken: list[MemorySample] = []

    def on_stream(text: str) -> None:
        if READY_MARKER in text and not taken:
            taken.append(sample_memory(kernel))

    kernel.run(taas_cell("forkserver", 2, f"held = {name}\n" + HOLD_BODY), on_stream=on_stream)
    if not taken or taken[0].ranks < 2:
        raise BenchError(f"no memory sample with both ranks alive: {taken}")
    return taken[0]


def measure_shipping(settings: Settings, tally: Tally, progress: Callable[[str], None]) -> dict:
    """Time, rate and memory of shipping a 512 MiB tensor to 2 spawned ranks."""
    with fresh_kernel(tally, TAAS_SETUP, wait_for_fork_server=True) as kernel:
        kernel.run("small = torch.ones(16)")
        before_big = sample_memory(kernel)
        kernel.run(f"big = torch.ones({BIG_NUMEL})")
        with_big = sample_memory(kernel)
        trivial, shipped = [], []
        for round_ in range(settings.shipping_rounds + 1):
            time.sleep(PAUSE_SECONDS)
            trivial_cell = kernel.run(taas_cell("forkserver", 2)).kernel_seconds
            time.sleep(PAUSE_SECONDS)
            shipped_cell = kernel.run(taas_cell("forkserver", 2, SHIP_BODY)).kernel_seconds
            if round_:
                trivial.append(trivial_cell)
                shipped.append(shipped_cell)
        pack = kernel_pack_seconds(kernel)
        baseline = memory_while_held(kernel, "small")
        held = memory_while_held(kernel, "big")
        after = sample_memory(kernel)
    progress("shipping")
    return shipping_figures(
        trivial,
        shipped,
        pack,
        {"before_big": before_big, "with_big": with_big, "small_held": baseline, "big_held": held, "after": after},
    )


def kernel_pack_seconds(kernel: Kernel) -> float | None:
    """The kernel's share of shipping (pickle + copy into the memory file), timed in the kernel.

    Uses taas-magic's own packing function; if its interface has changed, the figure is left out.
    """
    cell = kernel.execute(PACK_CELL, timeout=120)
    return None if cell.error else inside_seconds(cell)


def shipping_figures(
    trivial: list[float], shipped: list[float], pack: float | None, memory: dict[str, MemorySample]
) -> dict:
    extra_seconds = statistics.median(shipped) - statistics.median(trivial)
    held, baseline = memory["big_held"], memory["small_held"]
    extra = held.total_pss - baseline.total_pss
    return {
        "tensor_bytes": BIG_BYTES,
        "trivial_forkserver_seconds": trivial,
        "shipping_cell_seconds": shipped,
        "extra_seconds": extra_seconds,
        "gb_per_second": BIG_BYTES / extra_seconds / 1e9 if extra_seconds > 0 else float("inf"),
        "kernel_pack_seconds": pack,
        "memory": {
            "kernel_rss_before_big": memory["before_big"].kernel_rss,
            "kernel_rss_with_big": memory["with_big"].kernel_rss,
            "kernel_rss_while_ranks_hold_it": held.kernel_rss,
            "kernel_rss_after": memory["after"].kernel_rss,
            "kernel_extra_pss": held.kernel_pss - baseline.kernel_pss,
            "server_extra_pss": held.server_pss - baseline.server_pss,
            "server_extra_rss": held.server_rss - baseline.server_rss,
            "ranks_extra_pss": held.ranks_pss - baseline.ranks_pss,
            "ranks_extra_rss": held.ranks_rss - baseline.ranks_rss,
            "shmem_extra": held.shmem - baseline.shmem,
            "extra_bytes": extra,
            "extra_copies": extra / BIG_BYTES,
            "samples": {name: vars(sample) for name, sample in memory.items()},
        },
    }


# -- report ------------------------------------------------------------------------------------
ROWS = (  # (label, key, the Accelerate figure it is compared with)
    ("taas --start fork, cold", "fork/cold", "accelerate/cold"),
    ("taas --start fork, warm", "fork/warm", "accelerate/warm"),
    ("taas --start fork, warm back-to-back", "fork/warm back-to-back", "accelerate/warm back-to-back"),
    ("taas --start forkserver, cold (right after load)", "forkserver/cold", "accelerate/cold"),
    ("taas --start forkserver, warm", "forkserver/warm", "accelerate/warm"),
    ("taas --start forkserver, warm back-to-back", "forkserver/warm back-to-back", "accelerate/warm back-to-back"),
    ("accelerate notebook_launcher, cold", "accelerate/cold", "accelerate/cold"),
    ("accelerate notebook_launcher, warm", "accelerate/warm", "accelerate/warm"),
    ("accelerate notebook_launcher, back-to-back", "accelerate/warm back-to-back", "accelerate/warm back-to-back"),
    ("torchrun --standalone (subprocess)", "torchrun/cold", "accelerate/cold"),
)


def medians(samples: Samples) -> dict[str, dict[int, float]]:
    return {
        key: {ranks: statistics.median(values) for ranks, values in by_ranks.items()}
        for key, by_ranks in samples.items()
    }


def table(median: dict[str, dict[int, float]]) -> str:
    head = f"{'median wall time, seconds':<46}" + "".join(f"{f'{n} ranks':>10}{'/ accel.':>10}" for n in RANKS)
    lines = [head, "-" * len(head)]
    for label, key, reference in ROWS:
        cells = "".join(f"{median[key][n]:>10.3f}{median[key][n] / median[reference][n]:>9.2f}x" for n in RANKS)
        lines.append(f"{label:<46}{cells}")
    lines.append("ratios: against Accelerate in the same phase (cold, warm or back-to-back); torchrun against cold")
    return "\n".join(lines)


BARE_ROWS = (  # (label, contender), each against the bare launcher and Accelerate in the same kind of kernel
    ("bare os.fork launcher (20 lines)", "bare"),
    ("taas --start fork", "fork"),
    ("taas --start forkserver", "forkserver"),
    ("accelerate notebook_launcher", "accelerate"),
)
BARE_TARGET = 1.15  # taas fork's time against the bare launcher's: the ranks' own work and little else


def warm_key(contender: str, kind: KernelKind, client: bool = True) -> str:
    """The key of a paced warm series: client round trip by default, else the kernel's busy->idle."""
    return f"{contender}/warm{kind.suffix}" + (" client" if client else "")


def bare_table(median: dict[str, dict[int, float]], rounds: int) -> str:
    head = f"{f'warm cell, client round trip (median of {rounds}), s':<48}" + "".join(
        f"{f'{n} ranks':>10}{'/ bare':>9}{'/ accel.':>10}" for n in RANKS
    )
    lines = [head, "-" * len(head)]
    for kind in KINDS:
        lines.append(kind.label)
        bare, accelerate = median[warm_key("bare", kind)], median[warm_key("accelerate", kind)]
        for label, name in BARE_ROWS:
            values = median[warm_key(name, kind)]
            cells = "".join(
                f"{values[n]:>10.3f}{values[n] / bare[n]:>8.2f}x{values[n] / accelerate[n]:>9.2f}x" for n in RANKS
            )
            lines.append(f"  {label:<46}{cells}")
    return "\n".join(lines)


def bare_lines(median: dict[str, dict[int, float]]) -> list[str]:
    """taas fork's time beyond the bare launcher's, and what the heavy kernel adds to each contender."""
    lines = []
    for client, how in ((True, "client round trip"), (False, "kernel busy->idle")):
        extra = {
            kind: {
                n: 1000 * (median[warm_key("fork", kind, client)][n] - median[warm_key("bare", kind, client)][n])
                for n in RANKS
            }
            for kind in KINDS
        }
        lines.append(
            f"taas fork beyond bare ({how}): "
            + "; ".join(f"{kind.name} kernel " + _per_ranks(extra[kind], "{:+.1f} ms") for kind in KINDS)
        )
    added = {
        name: 1000 * (median[warm_key(name, HEAVY)][4] - median[warm_key(name, LIGHT)][4]) for _, name in BARE_ROWS
    }
    lines.append(
        "what the heavy kernel adds at 4 ranks (client round trip): "
        + ", ".join(f"{name} {ms:+.1f} ms" for name, ms in added.items())
    )
    return lines


def overhead_line(median: dict[str, dict[int, float]]) -> str:
    """How much of a cell's busy->idle time is IPython's, not the launcher's: the method's blind spot."""
    shares = {n: 1000 * (median["accelerate/warm"][n] - median["accelerate/warm inside cell"][n]) for n in RANKS}
    return (
        "IPython's own share of a warm Accelerate cell (busy->idle minus perf_counter around the call): "
        + _per_ranks(shares, "{:.1f} ms")
    )


def checks(median: dict[str, dict[int, float]], shipping: dict) -> list[tuple[bool, str]]:
    """Each target with the figures it was judged on."""
    found = []
    for phase in ("cold", "warm"):
        ratios = {n: median[f"fork/{phase}"][n] / median[f"accelerate/{phase}"][n] for n in RANKS}
        found.append(
            (
                all(r <= 1.5 for r in ratios.values()),
                f"fork <= 1.5x Accelerate's time ({phase}): " + _per_ranks(ratios, "{:.2f}x"),
            )
        )
    for kind in KINDS:
        ratios = {n: median[warm_key("fork", kind)][n] / median[warm_key("bare", kind)][n] for n in RANKS}
        found.append(
            (
                ratios[4] <= BARE_TARGET,
                f"fork <= {BARE_TARGET:g}x bare at 4 ranks, {kind.name} kernel (warm, client round trip): "
                + _per_ranks(ratios, "{:.2f}x"),
            )
        )
    warm4 = median["forkserver/warm"][4]
    found.append((warm4 <= 0.5, f"warm forkserver <= 0.5 s at 4 ranks: {warm4:.3f} s"))
    speedups = {n: median["torchrun/cold"][n] / median["forkserver/warm"][n] for n in RANKS}
    found.append(
        (
            all(s >= 3 for s in speedups.values()),
            "warm forkserver >= 3x faster than torchrun: " + _per_ranks(speedups, "{:.1f}x"),
        )
    )
    rate = shipping["gb_per_second"]
    found.append((rate >= 1.0, f"shipping >= 1 GB/s: {rate:.2f} GB/s (512 MiB in {shipping['extra_seconds']:.3f} s)"))
    copies = shipping["memory"]["extra_copies"]
    found.append(
        (
            copies <= 1 + COPY_TOLERANCE,
            f"kernel + fork server + ranks hold <= one extra copy: {copies:.2f} copies "
            f"({shipping['memory']['extra_bytes'] / 2**20:.0f} MiB; tolerance {COPY_TOLERANCE:.0%})",
        )
    )
    return found


def _per_ranks(values: dict[int, float], form: str) -> str:
    return ", ".join(f"{n} ranks {form.format(v)}" for n, v in values.items())


def shipping_lines(shipping: dict) -> list[str]:
    memory = shipping["memory"]
    mib = 2**20
    pack = shipping["kernel_pack_seconds"]
    return [
        f"shipping 512 MiB to 2 spawned ranks: cell {statistics.median(shipping['shipping_cell_seconds']):.3f} s, "
        f"trivial forkserver cell {statistics.median(shipping['trivial_forkserver_seconds']):.3f} s, "
        f"difference {shipping['extra_seconds']:.3f} s = {shipping['gb_per_second']:.2f} GB/s"
        + (f" (the kernel's pack into the memory file alone: {pack:.3f} s)" if pack is not None else ""),
        f"kernel RSS: {memory['kernel_rss_before_big'] / mib:.0f} MiB before the tensor, "
        f"{memory['kernel_rss_with_big'] / mib:.0f} MiB with it, "
        f"{memory['kernel_rss_while_ranks_hold_it'] / mib:.0f} MiB while the ranks hold it, "
        f"{memory['kernel_rss_after'] / mib:.0f} MiB after",
        f"extra while 2 ranks hold it (against the same cell holding 16 elements): "
        f"kernel PSS {memory['kernel_extra_pss'] / mib:+.0f} MiB, "
        f"fork server PSS {memory['server_extra_pss'] / mib:+.0f} MiB (RSS {memory['server_extra_rss'] / mib:+.0f}), "
        f"ranks PSS {memory['ranks_extra_pss'] / mib:+.0f} MiB (RSS {memory['ranks_extra_rss'] / mib:+.0f}); "
        f"system Shmem {memory['shmem_extra'] / mib:+.0f} MiB",
    ]


def trouble_lines(tally: Tally) -> list[str]:
    """Hung launches and surviving processes: left out of the medians, so said out loud here."""
    hangs = [
        f"{name} {sum(by.values())} of {tally.launches.get(name, 0)} ("
        + ", ".join(f"{count} at {n} ranks" for n, count in sorted(by.items()))
        + ")"
        for name, by in tally.hangs.items()
    ]
    lines = [
        f"launches that hung (killed after {HANG_SECONDS:g} s, not in the medians): "
        + ("; ".join(hangs) if hangs else "none")
    ]
    lines.append(f"processes alive after their kernel was shut down: {len(tally.left_behind) or 'none'}")
    if tally.left_after_hang:
        lines.append(
            f"processes alive 5 s after killing a kernel stuck in a launch (then killed): {len(tally.left_after_hang)}"
        )
    return lines


def write_results(
    path: Path,
    info: dict,
    settings: Settings,
    tally: Tally,
    shipping: dict,
    found: list[tuple[bool, str]],
    seconds: float,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": info,
        "settings": {**vars(settings), "pause_seconds": PAUSE_SECONDS, "hang_seconds": HANG_SECONDS},
        "timing": (
            "notebook contenders: kernel busy->idle (iopub stamps); keys ending in 'client': execute "
            "request to idle seen by the client; torchrun: subprocess wall time"
        ),
        "warm_kernels": [
            {"kernel": kind.name, "contenders": [contender.name for contender in contenders]}
            for kind, contenders in WARM_KERNELS
        ],
        "bare_launcher": BARE_SETUP,
        "heavy_kernel_setup": HEAVY_SETUP,
        "medians_seconds": {key: {str(n): v for n, v in by.items()} for key, by in medians(tally.samples).items()},
        "samples_seconds": {key: {str(n): v for n, v in by.items()} for key, by in tally.samples.items()},
        "launches": tally.launches,
        "hangs": {name: {str(n): count for n, count in by.items()} for name, by in tally.hangs.items()},
        "shipping": shipping,
        "checks": [{"passed": ok, "check": text} for ok, text in found],
        "left_behind": tally.left_behind,
        "left_behind_after_killing_a_hung_kernel": tally.left_after_hang,
        "benchmark_seconds": round(seconds, 1),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def load_average() -> list[float]:
    return [round(load, 2) for load in os.getloadavg()]


# -- plot --------------------------------------------------------------------------------------
BARS = (  # (label, key, colour, hatch): hatched = cold, solid = warm
    ("taas fork, cold", "fork/cold", "#1f77b4", "//"),
    ("taas fork, warm", "fork/warm", "#1f77b4", ""),
    ("taas forkserver, cold", "forkserver/cold", "#2ca02c", "//"),
    ("taas forkserver, warm", "forkserver/warm", "#2ca02c", ""),
    ("Accelerate, cold", "accelerate/cold", "#ff7f0e", "//"),
    ("Accelerate, warm", "accelerate/warm", "#ff7f0e", ""),
    ("torchrun (always cold)", "torchrun/cold", "#7f7f7f", "//"),
)


PANEL_BARS = (  # (label, contender, colour): the second panel, warm cells in light and heavy kernels
    ("bare os.fork launcher", "bare", "#7f7f7f"),
    ("taas fork", "fork", "#1f77b4"),
    ("taas forkserver", "forkserver", "#2ca02c"),
    ("Accelerate", "accelerate", "#ff7f0e"),
)


def plot(path: Path, samples: Samples, info: dict) -> None:
    """Left: every contender, cold and warm; right: warm cells against the bare launcher, light and heavy kernels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(17, 6), dpi=120, width_ratios=(1.15, 1))
    plot_contenders(left, samples)
    plot_kernels(right, samples)
    figure.suptitle(
        "Launching a distributed job from a notebook: taas-magic, a bare os.fork launcher, Accelerate, "
        f"torchrun\n{info['usable_cores']} cores, torch {info['torch']}, accelerate {info['accelerate']}, "
        f"{info['date'][:10]}; trivial gloo job on CPU: init_process_group, all_reduce, barrier, "
        "destroy_process_group",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def plot_contenders(axes: Axes, samples: Samples) -> None:
    """Grouped bars, one group per rank count; log scale, since torchrun is an order of magnitude off."""
    from matplotlib import ticker

    median = medians(samples)
    width = 0.8 / len(BARS)
    for index, (label, key, colour, hatch) in enumerate(BARS):
        xs = [group + (index - (len(BARS) - 1) / 2) * width for group in range(len(RANKS))]
        heights = [median[key][n] for n in RANKS]
        low = [h - min(samples[key][n]) for h, n in zip(heights, RANKS)]
        high = [max(samples[key][n]) - h for h, n in zip(heights, RANKS)]
        axes.bar(
            xs,
            heights,
            width * 0.92,
            label=label,
            color="white" if hatch else colour,
            edgecolor=colour,
            hatch=hatch,
            linewidth=1.2,
            yerr=[low, high],
            capsize=2,
            error_kw={"elinewidth": 0.8, "ecolor": "#444444"},
        )
        for x, h, top in zip(xs, heights, high):
            axes.text(x, (h + top) * 1.1, f"{h:.2f}", ha="center", va="bottom", fontsize=7)
    axes.set_yscale("log")
    axes.yaxis.set_major_locator(ticker.FixedLocator([0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]))
    axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axes.yaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_xticks(range(len(RANKS)), [f"{n} ranks" for n in RANKS])
    axes.set_ylabel("kernel busy->idle, s (median; whiskers min-max; log scale)")
    axes.set_title(
        "Light kernel (torch only); hatched: cold (first launch in a fresh kernel), solid: warm", fontsize=10
    )
    axes.set_ylim(min(0.05, min(min(by.values()) for by in median.values()) / 2), axes.get_ylim()[1] * 4)
    axes.grid(axis="y", which="both", alpha=0.25)
    axes.legend(fontsize=8, ncol=4, loc="upper center")


def plot_kernels(axes: Axes, samples: Samples) -> None:
    """Warm cells by client round trip, one group per kernel and rank count; labels: median and ratio to bare."""
    median = medians(samples)
    groups = [(kind, n) for kind in KINDS for n in RANKS]
    width = 0.8 / len(PANEL_BARS)
    for index, (label, name, colour) in enumerate(PANEL_BARS):
        xs = [group + (index - (len(PANEL_BARS) - 1) / 2) * width for group in range(len(groups))]
        keys = [warm_key(name, kind) for kind, _ in groups]
        heights = [median[key][n] for key, (_, n) in zip(keys, groups)]
        low = [h - min(samples[key][n]) for h, key, (_, n) in zip(heights, keys, groups)]
        high = [max(samples[key][n]) - h for h, key, (_, n) in zip(heights, keys, groups)]
        axes.bar(
            xs,
            heights,
            width * 0.92,
            label=label,
            color=colour,
            yerr=[low, high],
            capsize=2,
            error_kw={"elinewidth": 0.8, "ecolor": "#444444"},
        )
        for x, h, top, (kind, n) in zip(xs, heights, high, groups):
            ratio = h / median[warm_key("bare", kind)][n]
            axes.text(x, h + top, f"{h:.3f}\n{ratio:.2f}x", ha="center", va="bottom", fontsize=6.5)
    axes.axvline(len(RANKS) - 0.5, color="#999999", linestyle="--", linewidth=0.8)
    axes.set_xticks(range(len(groups)), [f"{kind.name} kernel, {n} ranks" for kind, n in groups])
    axes.set_ylabel("warm cell, client round trip, s (median; whiskers min-max)")
    axes.set_title(
        f"Against a bare os.fork launcher in the same kernel (target: taas fork <= {BARE_TARGET:g}x bare)\n"
        f"{HEAVY.label}; labels: median, ratio to bare",
        fontsize=10,
    )
    axes.set_ylim(0, axes.get_ylim()[1] * 1.2)
    axes.grid(axis="y", alpha=0.25)
    axes.legend(fontsize=8, ncol=4, loc="upper left")


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, "fewer repetitions (about 2 minutes on a quiet machine)", RESULTS, PLOT, argv)
    settings = QUICK if args.quick else FULL
    progress = Progress()
    tally = Tally()
    load_at_start = load_average()
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) / 2:
        print(
            f"note: load average {load:.1f} on {os.cpu_count()} cores before starting: other work is running, "
            "expect noisy figures",
            file=sys.stderr,
        )
    measure_warm(settings, tally, progress)
    measure_cold(settings, tally, progress)
    measure_torchrun(settings, tally, progress)
    shipping = measure_shipping(settings, tally, progress)
    info = {**machine_info("accelerate"), "load_average_at_end": load_average(), "load_average_at_start": load_at_start}
    median = medians(tally.samples)
    found = checks(median, shipping)
    print(table(median))
    print(overhead_line(median))
    print()
    print(bare_table(median, settings.warm_rounds))
    print("\n".join(bare_lines(median)))
    print()
    print("\n".join(shipping_lines(shipping)))
    print()
    print_checks(found)
    print("\n".join(trouble_lines(tally)))
    elapsed = progress.elapsed()
    write_results(args.results, info, settings, tally, shipping, found, elapsed)
    plot(args.plot, tally.samples, info)
    print(f"wrote {shown(args.results)} and {shown(args.plot)} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
