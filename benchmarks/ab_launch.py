"""Launch time of this checkout against another commit of taas-magic, in the same run: A/B.

A change meant to keep behaviour (a redesign, a clean-up) must not make a cell slower to start. This
runs the launch benchmark's trivial job (``launch.py``: init_process_group, one all_reduce, barrier,
destroy) as a taas cell at 2 and 4 ranks, ``--start fork`` and ``--start forkserver``, in two light
kernels side by side: two import taas_magic from ``--baseline`` (a git ref, exported to a temporary
folder), two from a copy of this checkout's ``src``, started in the order A B B A. All stay open and take
turns cell by cell, the order rotated every round, so the machine's noise falls on both sides alike. Every figure is a
median of 2 × ``--rounds`` warm cells (client round trip, as a user waits), after one unmeasured cell each.

    python benchmarks/ab_launch.py --baseline main~1          # about 2 minutes on 2 cores
    python benchmarks/ab_launch.py --baseline v0.1.0 --rounds 40

Prints one line per contender and its ratio (this checkout / baseline) with PASS where it is within
``--tolerance`` (3 %) of the baseline or faster; writes the figures to benchmarks/results/ab_launch.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, Kernel, Progress, machine_info, print_checks, shown
from launch import PAUSE_SECONDS, RANKS, TAAS_SETUP, taas_cell

RESULTS = ROOT / "benchmarks" / "results" / "ab_launch.json"
STARTS = ("fork", "forkserver")
# Two kernels a side, started A B B A: a kernel started earlier or later than another can be a little
# faster for reasons of its own (measured: up to 10 % between two kernels of the same code).
SIDES = ("baseline", "checkout", "checkout", "baseline")


def export(ref: str, into: Path) -> Path:
    """The ``src`` folder of commit ``ref``, written under ``into``."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def copy_checkout(into: Path) -> Path:
    """This checkout's ``src`` as it is now (uncommitted changes too), written under ``into``."""
    shutil.copytree(ROOT / "src", into / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return into / "src"


def open_kernel(src: Path) -> Kernel:
    """A light kernel importing taas_magic from ``src``, its fork server idle, torch imported."""
    kernel = Kernel(env={"PYTHONPATH": str(src)})
    try:
        where = kernel.run("import taas_magic as _t\nprint(_t.__file__)\ndel _t").stdout.strip()
        if not where.startswith(str(src)):
            raise RuntimeError(f"the kernel for {src} imports taas_magic from {where}")
        kernel.run(TAAS_SETUP)
        kernel.wait_fork_server_idle()
        for start in STARTS:
            for ranks in RANKS:
                kernel.run(taas_cell(start, ranks))  # the first cell of each kind is not measured
        kernel.wait_until_quiet()
    except BaseException:
        kernel.shutdown()
        raise
    return kernel


def measure(kernels: list[tuple[str, Kernel]], rounds: int, progress: Progress) -> dict[str, dict[str, list[float]]]:
    """{contender: {"baseline"|"checkout": [client seconds, ...]}}, cells interleaved round by round."""
    times: dict[str, dict[str, list[float]]] = {
        f"{start} {ranks} ranks": {side: [] for side, _ in kernels} for start in STARTS for ranks in RANKS
    }
    for round_number in range(rounds):
        # Rotated every round: the first cell after another kind of cell is a little slower, and each
        # kernel takes each place in turn.
        turn = round_number % len(kernels)
        order = kernels[turn:] + kernels[:turn]
        for start in STARTS:
            for ranks in RANKS:
                for side, kernel in order:
                    time.sleep(PAUSE_SECONDS)
                    cell = kernel.run(taas_cell(start, ranks))
                    times[f"{start} {ranks} ranks"][side].append(cell.client_seconds)
        progress(f"round {round_number + 1} of {rounds}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the git ref to compare with (a commit, a branch, a tag)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=20,
        help="rounds of warm cells; each kernel runs one of each kind per round (default 20)",
    )
    parser.add_argument("--tolerance", type=float, default=0.03, help="allowed slowdown (default 0.03: 3 %%)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON output (default: %(default)s)")
    settings = parser.parse_args(argv)
    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="taas-ab-") as folder:
        # Both sides from copies in the same place, so that nothing but the code differs between them.
        sources = {
            "baseline": export(settings.baseline, Path(folder) / "baseline"),
            "checkout": copy_checkout(Path(folder) / "checkout"),
        }
        kernels: list[tuple[str, Kernel]] = []
        try:
            for side in SIDES:
                progress(f"starting a {side} kernel ({sources[side]})")
                kernels.append((side, open_kernel(sources[side])))
            times = measure(kernels, settings.rounds, progress)
        finally:
            for _, kernel in kernels:
                kernel.shutdown()
    medians = {
        contender: {name: statistics.median(values) for name, values in sides.items()}
        for contender, sides in times.items()
    }
    print(f"launch of a trivial gloo job, warm, client round trip; medians of {2 * settings.rounds} cells a side")
    print(f"{'contender':<22}{settings.baseline[:14]:>16}{'this checkout':>16}{'ratio':>9}")
    checks = []
    for contender, sides in medians.items():
        ratio = sides["checkout"] / sides["baseline"]
        print(f"{contender:<22}{sides['baseline']:>15.3f}s{sides['checkout']:>15.3f}s{ratio:>9.3f}")
        checks.append(
            (
                ratio <= 1 + settings.tolerance,
                f"{contender}: {ratio:.3f}x the baseline (allowed {1 + settings.tolerance:.2f}x)",
            )
        )
    print_checks(checks)
    settings.results.parent.mkdir(parents=True, exist_ok=True)
    settings.results.write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "baseline": settings.baseline,
                "commit": _commit(settings.baseline),
                "rounds": settings.rounds,
                "seconds": times,
                "medians": medians,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"figures: {shown(settings.results)}", file=sys.stderr)
    return 0


def _commit(ref: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True, text=True
    ).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
