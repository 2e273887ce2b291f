"""Names between the notebook and kept workers: taas's `%taas pull` / `%taas push` beside ipyparallel's
`view.pull` / `view.push`, on as many workers.

Both keep worker processes alive between cells: a taas session (`#pragma taas --keep`, forked) and
ipyparallel's engines. Each moves the same values between its kernel and 4 workers, in a kernel of
its own, in alternating rounds:

  pull small   every worker's `step` (an int) into the notebook: a taas.PerRank / a list
  pull 4 MB    every worker's `weights` (a 4 MB float32 tensor), the same
  push small   the notebook's `lr` (a float) to every worker
  push 4 MB    the notebook's `payload` (a 4 MB float32 tensor) to every worker

Times are the kernel's own busy→idle stamps of the cell (what a notebook shows as the cell's time);
medians over the rounds, and the ratio taas / ipyparallel per operation.

Run: ``python benchmarks/pull_push.py`` (``--quick``: fewer rounds).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness import ROOT, BenchError, Kernel, Progress, arguments, machine_info, plot_axes, save_plot, shown

WORKERS = 4
MAKE = "import torch\nstep = 7\nweights = torch.full((1024, 1024), 0.5)\npayload = weights.clone()\nlr = 0.1"
OPERATIONS = ("pull small", "pull 4 MB", "push small", "push 4 MB")


@dataclass
class Contender:
    name: str
    setup: list[str]  # cells run once: start the workers and give each the values
    cells: dict[str, str]  # operation -> its cell
    check: dict[str, str]  # operation -> an expression that must be True after it
    teardown: str
    kernel: Kernel | None = None
    ms: dict[str, list[float]] = field(default_factory=dict)


def contenders(profile_dir: Path) -> list[Contender]:
    taas = Contender(
        "taas session",
        ["%load_ext taas_magic\n" + MAKE, f"#pragma taas --gpus {WORKERS} --keep --start fork --return none\n{MAKE}"],
        {
            "pull small": "%taas pull step",
            "pull 4 MB": "%taas pull weights",
            "push small": "%taas push lr",
            "push 4 MB": "%taas push payload",
        },
        {
            "pull small": f"list(step) == [7] * {WORKERS}",
            "pull 4 MB": f"len(weights) == {WORKERS}",
            "push small": "True",
            "push 4 MB": "True",
        },
        "%taas stop",
    )
    ipp = Contender(
        "ipyparallel",
        [
            f"import ipyparallel as ipp\n{MAKE}\n"
            f"cluster = ipp.Cluster(n={WORKERS}, controller_ip='127.0.0.1', controller_location='127.0.0.1', "
            f"profile_dir={str(profile_dir)!r}, log_level=40)\n"
            f"rc = cluster.start_and_connect_sync()\nrc.wait_for_engines({WORKERS}, timeout=120)\nview = rc[:]\n"
            f"view.execute({MAKE!r}, block=True)"
        ],
        {
            "pull small": "pulled = view.pull('step', block=True)",
            "pull 4 MB": "pulled = view.pull('weights', block=True)",
            "push small": "view.push({'lr': lr}, block=True)",
            "push 4 MB": "view.push({'payload': payload}, block=True)",
        },
        {
            "pull small": f"pulled == [7] * {WORKERS}",
            "pull 4 MB": f"len(pulled) == {WORKERS}",
            "push small": "True",
            "push 4 MB": "True",
        },
        "cluster.stop_cluster_sync()",
    )
    return [taas, ipp]


def measure(rounds: int, progress: Progress) -> list[Contender]:
    profile_dir = Path(tempfile.mkdtemp(prefix="taas-bench-ipyparallel-"))
    runners = contenders(profile_dir)
    try:
        for runner in runners:
            progress(f"starting {runner.name}")
            runner.kernel = Kernel()
            for cell in runner.setup:
                runner.kernel.run(cell, timeout=300)
            for operation in OPERATIONS:  # warm-up, and the check that each does what it says
                runner.kernel.run(runner.cells[operation])
                if "True" not in runner.kernel.run(f"print({runner.check[operation]})").stdout:
                    raise BenchError(f"{runner.name}: {operation} did not bring what it should")
            runner.kernel.wait_until_quiet()
        for round_number in range(rounds):
            for operation in OPERATIONS:
                for runner in runners if round_number % 2 else reversed(runners):
                    assert runner.kernel is not None
                    cell = runner.kernel.run(runner.cells[operation])
                    runner.ms.setdefault(operation, []).append(cell.kernel_seconds * 1000)
            if round_number % 10 == 0:
                progress(f"round {round_number + 1} of {rounds}")
    finally:
        for runner in runners:
            if runner.kernel is not None:
                try:
                    runner.kernel.run(runner.teardown, timeout=120)
                finally:
                    runner.kernel.shutdown()
        shutil.rmtree(profile_dir, ignore_errors=True)
    return runners


def report(runners: list[Contender], results: Path, plot: Path, rounds: int) -> None:
    taas, ipp = runners
    print(f"{WORKERS} workers, {rounds} rounds, medians of the kernel's busy->idle time")
    print(f"{'':12} {'taas':>10} {'ipyparallel':>12} {'taas / ipyparallel':>20}")
    for operation in OPERATIONS:
        ours, theirs = statistics.median(taas.ms[operation]), statistics.median(ipp.ms[operation])
        print(f"{operation:12} {ours:7.1f} ms {theirs:9.1f} ms {ours / theirs:19.2f}x")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "machine": machine_info("ipyparallel"),
                "workers": WORKERS,
                "rounds": rounds,
                "ms": {r.name: r.ms for r in runners},
            },
            indent=1,
        )
        + "\n"
    )
    figure, axes = plot_axes(7, 3.2)
    positions = range(len(OPERATIONS))
    for offset, runner in ((-0.2, taas), (0.2, ipp)):
        axes.barh(
            [p + offset for p in positions],
            [statistics.median(runner.ms[o]) for o in OPERATIONS],
            height=0.4,
            label=runner.name,
        )
    axes.set_yticks(list(positions), list(OPERATIONS))
    axes.set_xlabel(f"cell time, ms (median, {WORKERS} workers, CPU)")
    axes.legend(loc="lower right")
    save_plot(figure, plot)
    print(f"results: {shown(results)}; plot: {shown(plot)}")


def main(argv: list[str] | None = None) -> None:
    args = arguments(
        __doc__ or "",
        "10 rounds instead of 40",
        ROOT / "benchmarks/results/pull_push.json",
        ROOT / "docs/images/pull-push.png",
        argv,
    )
    rounds = 10 if args.quick else 40
    report(measure(rounds, Progress()), args.results, args.plot, rounds)


if __name__ == "__main__":
    main()
