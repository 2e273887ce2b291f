"""A warm cell in a session: what it costs beyond the cell itself, beside ipyparallel's %%px on as many engines.

Both keep worker processes alive between cells and run each cell in all of them: taas's
session (`#pragma taas --keep`, then bare `#pragma taas` cells) and ipyparallel's engines driven
by `%%px`. Each runs the same trivial body (`x = 1`) in 8 workers, in a kernel of its own, in
alternating rounds; the same body run in the kernel itself is the baseline. Overhead = median
cell time less the median baseline, on the kernel's own busy→idle stamps (what a notebook shows
as the cell's time); the client's request→idle times are printed beside them.

Run: ``python benchmarks/sessions.py`` (``--quick``: fewer rounds). The target: a warm session
cell costs at most 20 ms over the plain cell at 8 CPU ranks.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness import ROOT, BenchError, Kernel, Progress, arguments, machine_info, print_checks, shown

RANKS = 8
TARGET_MS = 20.0
BODY = "x = 1"
SESSION_CHECK = "import os\nprint('rank', os.environ['RANK'], os.getpid(), flush=True)"


@dataclass
class Contender:
    """One way to run a cell in kept workers: how to start them, the cell, how to stop them."""

    name: str
    setup: list[str]  # cells run once in its kernel
    cell: str  # the measured cell
    teardown: str
    kernel: Kernel | None = None
    kernel_ms: list[float] = field(default_factory=list)
    client_ms: list[float] = field(default_factory=list)


def contenders() -> list[Contender]:
    return [
        Contender("taas fork", ["%load_ext taas_magic", f"#pragma taas --gpus {RANKS} --keep --start fork --return none\n"
                  f"{SESSION_CHECK}"], f"#pragma taas --return none\n{BODY}", "%taas stop"),
        Contender("taas forkserver", ["%load_ext taas_magic", f"#pragma taas --gpus {RANKS} --keep --start forkserver "
                  f"--return none\n{SESSION_CHECK}"], f"#pragma taas --return none\n{BODY}", "%taas stop"),
        Contender("ipyparallel %%px", ["import ipyparallel as ipp\n"
                  f"cluster = ipp.Cluster(n={RANKS}, controller_ip='127.0.0.1', log_level=40)\n"
                  f"rc = cluster.start_and_connect_sync(activate=True)\nrc.wait_for_engines({RANKS}, timeout=120)"],
                  f"%%px\n{BODY}", "cluster.stop_cluster_sync()"),
    ]


def measure(rounds: int, progress: Progress) -> tuple[list[Contender], list[float]]:
    """Every contender in its own kernel, cells in alternating rounds; the plain cell in each kernel too."""
    runners = contenders()
    baseline: list[float] = []
    try:
        for runner in runners:
            progress(f"starting {runner.name}")
            runner.kernel = Kernel()
            if runner.name.startswith("taas"):
                runner.kernel.check_module("taas_magic")
            for cell in runner.setup:
                started = runner.kernel.run(cell, timeout=300)
            _check_workers(runner, started.stdout)
            for _ in range(3):  # warm-up: first cells touch pages and caches
                runner.kernel.run(runner.cell)
            runner.kernel.wait_until_quiet()
        for round_number in range(rounds):
            for runner in runners:
                assert runner.kernel is not None
                cell = runner.kernel.run(runner.cell)
                runner.kernel_ms.append(cell.kernel_seconds * 1000)
                runner.client_ms.append(cell.client_seconds * 1000)
                baseline.append(runner.kernel.run(BODY).kernel_seconds * 1000)
            if round_number % 20 == 0:
                progress(f"round {round_number + 1} of {rounds}")
    finally:
        for runner in runners:
            if runner.kernel is not None:
                try:
                    runner.kernel.run(runner.teardown, timeout=120)
                finally:
                    left = runner.kernel.shutdown()
                    if left:
                        print(f"{runner.name}: left behind and killed: {left}", file=sys.stderr)
    return runners, baseline


def _check_workers(runner: Contender, said: str) -> None:
    """Every worker is there, and (for taas) the measured cells run in the session, not as one-shot runs."""
    assert runner.kernel is not None
    if runner.name.startswith("taas"):
        if len(set(said.split())) < RANKS or "session:             up" not in runner.kernel.run("%taas").stdout:
            raise BenchError(f"{runner.name}: no session of {RANKS} ranks started:\n{said}")
    elif runner.kernel.run("print(len(rc.ids))").stdout.strip() != str(RANKS):
        raise BenchError(f"{runner.name}: fewer than {RANKS} engines")


def report(runners: list[Contender], baseline: list[float], results: Path, plot: Path, rounds: int) -> None:
    plain = statistics.median(baseline)
    overhead = {r.name: statistics.median(r.kernel_ms) - plain for r in runners}
    print(f"warm cell `{BODY}` in {RANKS} workers, {rounds} rounds; plain cell in the kernel: median {plain:.2f} ms")
    print(f"{'':20} {'kernel median':>14} {'p90':>8} {'client median':>14} {'overhead':>9}")
    for r in runners:
        p90 = statistics.quantiles(r.kernel_ms, n=10)[-1]
        print(f"{r.name:20} {statistics.median(r.kernel_ms):11.2f} ms {p90:5.1f} ms "
              f"{statistics.median(r.client_ms):11.2f} ms {overhead[r.name]:6.2f} ms")
    px = overhead["ipyparallel %%px"]
    for name in ("taas fork", "taas forkserver"):
        print(f"{name} / ipyparallel %%px overhead: {overhead[name] / px:.2f}x")
    print_checks([(overhead[name] <= TARGET_MS, f"{name}: a warm session cell costs {overhead[name]:.1f} ms over the "
                   f"plain cell at {RANKS} ranks (target <= {TARGET_MS:g} ms)") for name in ("taas fork", "taas forkserver")])
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps({
        "machine": machine_info("ipyparallel"), "ranks": RANKS, "rounds": rounds, "plain_ms": baseline,
        "contenders": {r.name: {"kernel_ms": r.kernel_ms, "client_ms": r.client_ms, "overhead_ms": overhead[r.name]}
                       for r in runners},
    }, indent=1) + "\n")
    _plot(runners, plain, plot)
    print(f"results: {shown(results)}; plot: {shown(plot)}")


def _plot(runners: list[Contender], plain: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.2))
    axes.boxplot([[ms - plain for ms in r.kernel_ms] for r in runners], orientation="horizontal", showfliers=False,
                 tick_labels=[r.name for r in runners])
    axes.axvline(TARGET_MS, color="tab:red", linestyle="--", linewidth=1, label=f"target {TARGET_MS:g} ms")
    axes.set_xlabel(f"warm cell time beyond the plain cell, ms ({RANKS} workers, CPU)")
    axes.legend(loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = arguments(__doc__ or "", "20 rounds instead of 100", ROOT / "benchmarks/results/sessions.json",
                     ROOT / "docs/images/sessions.png", argv)
    rounds = 20 if args.quick else 100
    runners, baseline = measure(rounds, Progress())
    report(runners, baseline, args.results, args.plot, rounds)


if __name__ == "__main__":
    main()
