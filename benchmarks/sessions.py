"""A warm cell in a session: what it costs beyond the cell itself, beside ipyparallel's %%px on as many engines.

Both keep worker processes alive between cells and run each cell in all of them: taas's
session (`#pragma taas --keep`, then bare `#pragma taas` cells) and ipyparallel's engines driven
by `%%px`. Each runs the same trivial body (`x = 1`) in 8 workers, in a kernel of its own, in
alternating rounds; the same body run in the kernel itself is the baseline. Overhead = median
cell time less the median baseline, on the kernel's own busy→idle stamps (what a notebook shows
as the cell's time); the client's request→idle times are printed beside them.

Then what a session costs a training loop while nothing fails (it stops ranks together at an optimizer
step, notes its process group's sockets, heals dead ranks): the same DDP loop, timed inside, in a session's
cell and in a script started by ``torchrun`` (outside any notebook), in alternating rounds, on
``TRAIN_RANKS`` CPU ranks with the same intra-op threads each.

Run: ``python benchmarks/sessions.py`` (``--quick``: fewer rounds). The targets: a warm session
cell costs at most 20 ms over the plain cell at 8 CPU ranks; DDP steps/s in a session at least 0.98x
torchrun's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from harness import (
    BENCH_ENV,
    ROOT,
    BenchError,
    Kernel,
    Progress,
    arguments,
    machine_info,
    plot_axes,
    print_checks,
    save_plot,
    shown,
)

RANKS = 8
TARGET_MS = 20.0
BODY = "x = 1"
# ipyparallel shows what engines print as display data: their process ids are printed here instead.
PX_CHECK = "import os\nfor engine, pid in zip(rc.ids, rc[:].apply_sync(os.getpid)):\n    print('worker', engine, pid)"


@dataclass
class Contender:
    """One way to run a cell in kept workers: how to start them, the cell, how to stop them."""

    name: str
    setup: list[str]  # cells run once in its kernel, the last printing each worker's process id
    cell: str  # the measured cell
    check: str  # prints each worker's process id again
    teardown: str
    kernel: Kernel | None = None
    kernel_ms: list[float] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)
    plain_ms: list[float] = field(default_factory=list)  # `x = 1` run by this kernel itself
    workers: dict[str, str] = field(default_factory=dict)  # worker -> process id, as it started


def contenders(profile_dir: Path) -> list[Contender]:
    taas_check = "import os\nprint('worker', os.environ['RANK'], os.getpid(), flush=True)"
    return [
        Contender(
            "taas fork",
            ["%load_ext taas_magic", f"#pragma taas --gpus {RANKS} --keep --start fork --return none\n{taas_check}"],
            f"#pragma taas --return none\n{BODY}",
            f"#pragma taas --return none\n{taas_check}",
            "%taas stop",
        ),
        Contender(
            "taas forkserver",
            [
                "%load_ext taas_magic",
                f"#pragma taas --gpus {RANKS} --keep --start forkserver --return none\n{taas_check}",
            ],
            f"#pragma taas --return none\n{BODY}",
            f"#pragma taas --return none\n{taas_check}",
            "%taas stop",
        ),
        Contender(
            "ipyparallel %%px",
            [
                "import ipyparallel as ipp\n"
                f"cluster = ipp.Cluster(n={RANKS}, controller_ip='127.0.0.1', controller_location='127.0.0.1', "
                f"profile_dir={str(profile_dir)!r}, log_level=40)\n"
                f"rc = cluster.start_and_connect_sync(activate=True)\nrc.wait_for_engines({RANKS}, timeout=120)",
                PX_CHECK,
            ],
            f"%%px\n{BODY}",
            PX_CHECK,
            "cluster.stop_cluster_sync()",
        ),
    ]


def measure(rounds: int, progress: Progress) -> list[Contender]:
    """Every contender in its own kernel, taking turns; each kernel's plain cell after its own cell."""
    profile_dir = Path(tempfile.mkdtemp(prefix="taas-bench-ipyparallel-"))
    runners = contenders(profile_dir)
    try:
        for runner in runners:
            progress(f"starting {runner.name}")
            runner.kernel = Kernel()
            if runner.name.startswith("taas"):
                runner.kernel.check_module("taas_magic")
            for cell in runner.setup:
                said = runner.kernel.run(cell, timeout=300).stdout
            runner.workers = _workers(runner, said)
            for _ in range(3):  # warm-up: first cells touch pages and caches
                runner.kernel.run(runner.cell)
            runner.kernel.wait_until_quiet()
        _check_loopback(runners[-1])
        for round_number in range(rounds):
            for runner in runners:
                assert runner.kernel is not None
                cell = runner.kernel.run(runner.cell)
                runner.kernel_ms.append(cell.kernel_seconds * 1000)
                runner.client_ms.append(cell.client_seconds * 1000)
                runner.plain_ms.append(runner.kernel.run(BODY).kernel_seconds * 1000)
            if round_number % 20 == 0:
                progress(f"round {round_number + 1} of {rounds}")
        for runner in runners:
            assert runner.kernel is not None
            if _workers(runner, runner.kernel.run(runner.check).stdout) != runner.workers:
                raise BenchError(f"{runner.name}: the workers are not those that started: the cells did not run warm")
    finally:
        for runner in runners:
            _stop(runner)
        shutil.rmtree(profile_dir, ignore_errors=True)
    return runners


def _workers(runner: Contender, said: str) -> dict[str, str]:
    """Worker -> process id from what the check printed; all of them, or the figures mean nothing."""
    found = dict(re.findall(r"worker (\d+) (\d+)", said))
    if len(found) != RANKS:
        raise BenchError(f"{runner.name}: {len(found)} workers answered, not {RANKS}:\n{said}")
    return found


def _check_loopback(runner: Contender) -> None:
    """ipyparallel's controller and engines listen on loopback alone."""
    assert runner.kernel is not None
    processes = psutil.Process(runner.kernel.pid).children(recursive=True)
    listening = [c.laddr.ip for p in processes for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    outside = [ip for ip in listening if not ip.startswith("127.")]
    if not listening or outside:
        raise BenchError(f"{runner.name} listens on {outside or 'nothing'}: expected loopback alone")


def _stop(runner: Contender) -> None:
    """End the contender's workers and kernel, whatever happened; kill and report what is left."""
    if runner.kernel is None:
        return
    try:
        runner.kernel.run(runner.teardown, timeout=120)
    except BenchError as e:
        print(f"{runner.name}: {e}", file=sys.stderr)
    finally:
        left = runner.kernel.shutdown()
        if left:
            print(f"{runner.name}: left behind and killed: {left}", file=sys.stderr)


def report(runners: list[Contender], results: Path, plot: Path, rounds: int, training: "Training") -> None:
    overhead = {r.name: statistics.median(r.kernel_ms) - statistics.median(r.plain_ms) for r in runners}
    print(
        f"warm cell `{BODY}` in {RANKS} workers, {rounds} rounds; busy->idle as the kernel stamps it, "
        "less the same cell run by that kernel itself"
    )
    print(f"{'':20} {'cell median':>12} {'p90':>8} {'plain':>8} {'overhead':>9} {'client round trip':>18}")
    for r in runners:
        p90 = statistics.quantiles(r.kernel_ms, n=10)[-1]
        print(
            f"{r.name:20} {statistics.median(r.kernel_ms):9.2f} ms {p90:5.1f} ms "
            f"{statistics.median(r.plain_ms):5.2f} ms {overhead[r.name]:6.2f} ms "
            f"{statistics.median(r.client_ms):15.2f} ms"
        )
    px = overhead["ipyparallel %%px"]
    for name in ("taas fork", "taas forkserver"):
        print(f"{name} / ipyparallel %%px overhead: {overhead[name] / px:.2f}x")
    print_checks(
        [
            (
                overhead[name] <= TARGET_MS,
                f"{name}: a warm session cell costs {overhead[name]:.1f} ms over the "
                f"plain cell at {RANKS} ranks (target <= {TARGET_MS:g} ms)",
            )
            for name in ("taas fork", "taas forkserver")
        ]
        + [training.report()]
    )
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "machine": machine_info("ipyparallel"),
                "ranks": RANKS,
                "rounds": rounds,
                "contenders": {
                    r.name: {
                        "kernel_ms": r.kernel_ms,
                        "client_ms": r.client_ms,
                        "plain_ms": r.plain_ms,
                        "overhead_ms": overhead[r.name],
                    }
                    for r in runners
                },
                "training": training.as_json(),
            },
            indent=1,
        )
        + "\n"
    )
    _plot(runners, plot)
    print(f"results: {shown(results)}; plot: {shown(plot)}")


# -- a training loop: a session's cell against torchrun ------------------------------------------------
TRAIN_RANKS = 2
TRAIN_TARGET = 0.98  # a session's steps/s at least this much of torchrun's
SETUP = """import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
batch = torch.randn(64, 512)
"""
LOOP = """def steps(count):
    for _ in range(count):
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()
steps(30)
dist.barrier()
began = time.perf_counter()
steps(300)
rate = 300 / (time.perf_counter() - began)
if dist.get_rank() == 0:
    print("steps/s", rate, "threads", torch.get_num_threads(), flush=True)
"""


@dataclass
class Training:
    """DDP steps/s of the same loop, each round in a session's cell and in a fresh ``torchrun``."""

    session: list[float] = field(default_factory=list)
    torchrun: list[float] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)  # each side's intra-op threads, as its rank 0 said

    @property
    def ratio(self) -> float:
        return statistics.median(self.session) / statistics.median(self.torchrun)

    def report(self) -> tuple[bool, str]:
        print(
            f"DDP training, {TRAIN_RANKS} CPU ranks, {len(self.session)} rounds of 300 steps: session "
            f"{statistics.median(self.session):.1f} steps/s, torchrun {statistics.median(self.torchrun):.1f} steps/s "
            f"(intra-op threads {', '.join(sorted(self.threads))})"
        )
        return (
            self.ratio >= TRAIN_TARGET,
            f"a session's DDP steps/s are {self.ratio:.3f}x torchrun's on the same loop (target >= {TRAIN_TARGET})",
        )

    def as_json(self) -> dict:
        return {"ranks": TRAIN_RANKS, "session": self.session, "torchrun": self.torchrun, "ratio": self.ratio}


def measure_training(rounds: int, progress: Progress) -> Training:
    """The loop in a session of ``TRAIN_RANKS`` (its model made once) and in ``torchrun`` (made each time),
    taking turns; both on loopback."""
    training = Training()
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-training-"))
    script = folder / "train.py"
    script.write_text(SETUP + LOOP)
    kernel = Kernel()
    try:
        kernel.check_module("taas_magic")
        kernel.run("%load_ext taas_magic")
        kernel.run(f"#pragma taas --gpus {TRAIN_RANKS} --keep --start fork --return none\n{SETUP}", timeout=300)
        threads = kernel.run("#pragma taas --return none\nprint(torch.get_num_threads())").stdout.split()[-1]

        def in_session() -> float:
            return _rate(kernel.run(f"#pragma taas --return none\n{LOOP}", timeout=300).stdout, training)

        def by_torchrun() -> float:
            return _rate(_torchrun(script, threads), training)

        for round_number in range(rounds):
            progress(f"training round {round_number + 1} of {rounds}")
            if round_number % 2:  # each goes first every other round: neither always follows the other's end
                training.torchrun.append(by_torchrun())
                training.session.append(in_session())
            else:
                training.session.append(in_session())
                training.torchrun.append(by_torchrun())
    finally:
        kernel.run("%taas stop")
        left = kernel.shutdown()
        if left:
            print(f"training: left behind and killed: {left}", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
    return training


def _torchrun(script: Path, threads: str) -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(TRAIN_RANKS)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(script)]
    env = {**os.environ, **BENCH_ENV, "OMP_NUM_THREADS": threads}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise BenchError(f"torchrun failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def _rate(said: str, training: Training) -> float:
    found = re.search(r"steps/s ([0-9.]+) threads (\d+)", said)
    if found is None:
        raise BenchError(f"no steps/s in:\n{said}")
    training.threads.add(found[2])
    return float(found[1])


def _plot(runners: list[Contender], path: Path) -> None:
    figure, axes = plot_axes(7, 3.2)
    axes.boxplot(
        [[ms - statistics.median(r.plain_ms) for ms in r.kernel_ms] for r in runners],
        orientation="horizontal",
        showfliers=False,
        tick_labels=[r.name for r in runners],
    )
    axes.axvline(TARGET_MS, color="tab:red", linestyle="--", linewidth=1, label=f"target {TARGET_MS:g} ms")
    axes.set_xlabel(f"warm cell time beyond the plain cell, ms ({RANKS} workers, CPU)")
    axes.legend(loc="lower right")
    save_plot(figure, path)


def main(argv: list[str] | None = None) -> None:
    args = arguments(
        __doc__ or "",
        "20 rounds instead of 100",
        ROOT / "benchmarks/results/sessions.json",
        ROOT / "docs/images/sessions.png",
        argv,
    )
    rounds = 20 if args.quick else 100
    progress = Progress()
    runners = measure(rounds, progress)
    training = measure_training(3 if args.quick else 9, progress)
    report(runners, args.results, args.plot, rounds, training)


if __name__ == "__main__":
    main()
