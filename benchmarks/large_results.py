"""A large tensor back from the ranks into the notebook: taas's `--return` beside what a user does without it.

Without taas, a value made by a distributed job reaches a notebook through a file: rank 0 saves it
(`torch.save`) and the notebook loads it (`torch.load`). Here both run in one kernel with 2 forked
ranks, for tensors of 8, 80 and 800 MB, in alternating rounds:

  taas         `--return x`: rank 0's x comes back as the cell ends
  save + load  rank 0 saves x into the notebook's folder (`--return none`), then the notebook loads it
  baseline     the same cell that makes x and returns nothing: what every way pays anyway

The time of moving x is each way's median cell time (the kernel's busy->idle stamps; for save + load,
both cells) less the baseline's median; throughput is the tensor's size over that time.

Run: ``python benchmarks/large_results.py`` (``--quick``: fewer rounds).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path

from harness import ROOT, Kernel, Progress, arguments, machine_info, plot_axes, save_plot, shown

SIZES_MB = (8, 80, 800)
WAYS = ("taas", "save + load", "baseline")
RANKS = 2


def cells(megabytes: int, folder: Path) -> dict[str, list[str]]:
    make = f"x = torch.full(({megabytes} * 2**18,), 0.5)"
    pragma = f"#pragma taas --gpus {RANKS} --start fork"
    path = folder / "x.pt"
    return {
        "taas": [f"{pragma} --return x\nimport torch\n{make}"],
        "save + load": [
            f"{pragma} --return none\nimport torch, taas\n{make}\n"
            f"if taas.rank() == 0:\n    torch.save(x, {str(path)!r})",
            f"x = torch.load({str(path)!r})",
        ],
        "baseline": [f"{pragma} --return none\nimport torch\n{make}"],
    }


def measure(rounds: int, progress: Progress) -> dict[int, dict[str, list[float]]]:
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-results-"))
    kernel = Kernel()
    seconds: dict[int, dict[str, list[float]]] = {size: {way: [] for way in WAYS} for size in SIZES_MB}
    try:
        kernel.run("%load_ext taas_magic\nimport torch")
        for size in SIZES_MB:
            ways = cells(size, folder)
            for way in WAYS:  # warm-up
                for cell in ways[way]:
                    kernel.run(cell, timeout=600)
            check = kernel.run(f"print(x.numel() == {size} * 2**18 and float(x[-1]) == 0.5)").stdout
            assert "True" in check, check
            for round_number in range(rounds):
                order = WAYS if round_number % 2 else tuple(reversed(WAYS))
                for way in order:
                    kernel.run("x = None")
                    spent = sum(kernel.run(cell, timeout=600).kernel_seconds for cell in ways[way])
                    seconds[size][way].append(spent)
            progress(f"{size} MB: {rounds} rounds")
    finally:
        kernel.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    return seconds


def report(seconds: dict[int, dict[str, list[float]]], results: Path, plot: Path, rounds: int) -> None:
    print(f"{RANKS} ranks, {rounds} rounds; time to move x = median cell time less the baseline's")
    print(f"{'':8} {'taas':>18} {'save + load':>20} {'taas / save + load':>20}")
    moved: dict[int, dict[str, float]] = {}
    for size in SIZES_MB:
        base = statistics.median(seconds[size]["baseline"])
        moved[size] = {way: max(statistics.median(seconds[size][way]) - base, 1e-4) for way in ("taas", "save + load")}
        ours, theirs = moved[size]["taas"], moved[size]["save + load"]
        ours_rate, their_rate = size / 1024 / ours, size / 1024 / theirs
        print(
            f"{size:5} MB {ours * 1000:8.0f} ms {ours_rate:5.1f} GB/s {theirs * 1000:9.0f} ms {their_rate:5.1f} GB/s"
            f" {ours / theirs:19.2f}x"
        )
    results.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine_info(), "ranks": RANKS, "rounds": rounds, "seconds": seconds, "moved": moved}
    results.write_text(json.dumps(data, indent=1) + "\n")
    figure, axes = plot_axes(7, 3.0)
    positions = range(len(SIZES_MB))
    for offset, way in ((-0.2, "taas"), (0.2, "save + load")):
        axes.barh(
            [p + offset for p in positions], [size / 1024 / moved[size][way] for size in SIZES_MB], 0.4, label=way
        )
    axes.set_yticks(list(positions), [f"{size} MB" for size in SIZES_MB])
    axes.set_xlabel("GB/s into the notebook (median, 2 ranks, CPU)")
    axes.legend(loc="lower right")
    save_plot(figure, plot)
    print(f"results: {shown(results)}; plot: {shown(plot)}")


def main(argv: list[str] | None = None) -> None:
    args = arguments(
        __doc__ or "",
        "3 rounds instead of 7",
        ROOT / "benchmarks/results/large_results.json",
        ROOT / "docs/images/large-results.png",
        argv,
    )
    rounds = 3 if args.quick else 7
    report(measure(rounds, Progress()), args.results, args.plot, rounds)


if __name__ == "__main__":
    main()
