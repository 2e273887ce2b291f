"""What the live view costs: a 4-rank cell printing 100k lines under redrawn tqdm bars, view on against view off.

With the view on, each rank's bar is drawn in its row and identical lines of several ranks are
collapsed; with it off (``%config TaasMagics.view = False``) the ranks' output goes to the cell
as written. The same kernel runs the same cell both ways in alternating rounds; the figure is
the client's round trip (request → idle, every line received), medians of the rounds.

Run: ``python benchmarks/live_view.py`` (``--quick``: fewer rounds). The target: the view on
costs at most 5% over the view off.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from harness import (
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

RANKS = 4
LINES = 100_000  # in all, over the ranks
TARGET = 1.05
CELL = f"""#pragma taas --gpus {RANKS} --return none
import os
from tqdm import tqdm
rank = int(os.environ["RANK"])
for step in tqdm(range({LINES // RANKS}), mininterval=0.02):
    print(f"rank {{rank}} step {{step}} loss {{step * 0.001:.3f}}")
    if step % 5000 == 0:
        print("checkpoint saved")
"""
MODES = {"view on": "True", "view off": "False"}


def measure(rounds: int, progress: Progress) -> dict[str, list[float]]:
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    kernel = Kernel()
    try:
        kernel.check_module("taas_magic")
        kernel.run("%load_ext taas_magic")
        for mode, setting in MODES.items():  # warm-up, and a check that every line arrives
            kernel.run(f"%config TaasMagics.view = {setting}")
            _check(mode, kernel.run(CELL, timeout=600).stdout)
        for round_number in range(rounds):
            for mode, setting in MODES.items() if round_number % 2 == 0 else reversed(MODES.items()):
                kernel.run(f"%config TaasMagics.view = {setting}")
                kernel.wait_until_quiet()
                seconds[mode].append(kernel.run(CELL, timeout=600).client_seconds)
            progress(
                f"round {round_number + 1} of {rounds}: "
                + ", ".join(f"{mode} {values[-1]:.2f} s" for mode, values in seconds.items())
            )
    finally:
        kernel.shutdown()
    return seconds


def _check(mode: str, stdout: str) -> None:
    lines = stdout.count(" step ")
    if lines != LINES:
        raise BenchError(f"{mode}: {lines} of {LINES} lines arrived")


def report(seconds: dict[str, list[float]], results: Path, plot: Path, rounds: int) -> None:
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    ratio = medians["view on"] / medians["view off"]
    print(f"{RANKS} ranks printing {LINES:,} lines in all under tqdm bars, {rounds} rounds; client round trip")
    for mode, values in seconds.items():
        print(f"{mode:10} median {medians[mode]:6.2f} s   min {min(values):6.2f} s   max {max(values):6.2f} s")
    print(f"view on / view off: {ratio:.3f}x")
    print_checks([(ratio <= TARGET, f"the live view costs {ratio - 1:+.1%} (target <= {TARGET - 1:+.0%})")])
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "ranks": RANKS,
                "lines": LINES,
                "rounds": rounds,
                "seconds": seconds,
                "ratio": ratio,
            },
            indent=1,
        )
        + "\n"
    )
    _plot(seconds, plot)
    print(f"results: {shown(results)}; plot: {shown(plot)}")


def _plot(seconds: dict[str, list[float]], path: Path) -> None:
    figure, axes = plot_axes(7, 2.4)
    axes.boxplot(list(seconds.values()), orientation="horizontal", tick_labels=list(seconds), showfliers=False)
    axes.set_xlabel(f"cell time, s ({RANKS} CPU ranks, {LINES:,} lines, tqdm bars)")
    save_plot(figure, path)


def main(argv: list[str] | None = None) -> None:
    args = arguments(
        __doc__ or "",
        "4 rounds instead of 9",
        ROOT / "benchmarks/results/live_view.json",
        ROOT / "docs/images/live-view-cost.png",
        argv,
    )
    rounds = 4 if args.quick else 9
    report(measure(rounds, Progress()), args.results, args.plot, rounds)


if __name__ == "__main__":
    main()
