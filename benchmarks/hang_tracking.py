"""What tracking a run for the hang watchdog costs a training loop: tracking on against off, in one kernel.

With the watchdog on (``--hang-after``, 120 s by default) each rank samples about once a second
where it is in its collectives (``taas_magic.rank.activity``), reading torch's flight recorder,
whose ring taas sizes to 64 entries (``TORCH_FR_BUFFER_SIZE``). With ``--hang-after 0`` a rank
samples nothing and taas leaves the recorder as torch sets it (recording, in a ring of 2000): that
is a run without taas's tracking, as torch would run it anyway.

One kernel runs the same 2-rank CPU cell (gloo) with tracking on and off in turns, A B B A, so each
pair of cells meets the same machine within seconds. Each cell times two loops inside the ranks
(``time.perf_counter()``; the slower rank counts), after a warm-up:

    ddp   DDP training steps of a small MLP (4 Linear layers of 128, batches of 32), its gradients
          in buckets of 64 KiB: every step all-reduces a few small buckets
    bare  bare ``dist.all_reduce`` of 1000 floats: the worst case, nothing but collectives

Each cell checks what it measured: the ranks' ``TORCH_FR_BUFFER_SIZE``, the ring's size, and that
the vitals thread sampled the activity (on) or not (off). The ratio on/off comes as the median of
the pairs' own ratios, with a bootstrap interval over the pairs: on a shared machine it says what
the run can tell apart. A last cell times ``activity.sample()`` itself, as it reads a rank that
moved since its last sample (the counters alone) and one that did not (the whole ring).

Run: ``python benchmarks/hang_tracking.py`` (about 4 minutes on 2 cores; ``--rounds``, ``--steps``
and ``--all-reduces`` size it). The target: tracking costs at most 2% of either loop.
Figures go to benchmarks/results/hang_tracking.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

from harness import ROOT, BenchError, Kernel, Progress, machine_info, print_checks, shown

from taas_magic.kernel.running.environment import FLIGHT_RECORDER_ENTRIES

RANKS = 2
TARGET = 1.02
WORKLOADS = ("ddp", "bare")
VARIANTS = {"on": "", "off": " --hang-after 0"}  # the cell's options beyond the shared ones
USER_CHOICES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # either makes taas leave the size alone
SAMPLES = 200  # activity.sample() calls timed per rank and kind
RECORD = re.compile(r"taas-bench (\{.*\})")
RESAMPLES = 2000  # bootstrap of the on/off ratio: how far the pairs let it move

# What every cell shares: the process group, the two loops' steps, what the ring holds, a timed loop.
PRELUDE = """\
import json, os, pickle, threading, time
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel
from taas_magic.rank import vitals

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)]),
                                bucket_cap_mb=1 / 16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 128), torch.randn(32, 128)
def ddp():
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
small = torch.zeros(1000)
def bare():
    dist.all_reduce(small)
def ring():
    try:
        return len(pickle.loads(c10d._dump_fr_trace(True, False, False))["entries"])
    except Exception:  # no ring
        return 0
def timed(name, step, count):
    for _ in range(50):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(count):
        step()
    seconds = time.perf_counter() - started
    print("taas-bench " + json.dumps(dict(workload=name, rank=rank, steps=count, seconds=seconds, ring=ring(),
                                          fr=os.environ.get("TORCH_FR_BUFFER_SIZE", "-"),
                                          tracked=vitals._track)), flush=True)
"""


def cell(options: str, body: str) -> str:
    return f"#pragma taas --gpus {RANKS} --device cpu --return none{options}\n{PRELUDE}{textwrap.dedent(body)}"


def loop_cell(options: str, steps: int, all_reduces: int) -> str:
    """The measured cell: both loops, one record per rank and loop."""
    return cell(
        options,
        f"""\
        timed("ddp", ddp, {steps})
        timed("bare", bare, {all_reduces})
        dist.destroy_process_group()
        """,
    )


SAMPLER_CELL = cell(
    "",
    f"""\
    from taas_magic.rank import activity
    for _ in range(3000):
        bare()
    dist.barrier()
    for kind in ("moved", "still"):
        taken = 0.0
        for _ in range({SAMPLES}):
            if kind == "moved":
                bare()  # the counters change between two samples, as in a training loop
            started = time.perf_counter()
            activity.sample()
            taken += time.perf_counter() - started
        print("taas-bench " + json.dumps(dict(workload="sampler", kind=kind, rank=rank, us=taken / {SAMPLES} * 1e6,
                                              ring=ring())), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    """,
)


def records(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORD.findall(stdout)]


def loop(variant: str, found: list[dict[str, Any]], workload: str, steps: int) -> float:
    """One loop of one cell: the slower rank's seconds, or BenchError when the cell did not run what it should."""
    mine = [r for r in found if r["workload"] == workload]
    if sorted(r["rank"] for r in mine) != list(range(RANKS)) or any(r["steps"] != steps for r in mine):
        raise BenchError(f"{variant} {workload}: the ranks reported {mine}")
    first = mine[0]
    expected = (FLIGHT_RECORDER_ENTRIES, int(FLIGHT_RECORDER_ENTRIES), True) if variant == "on" else ("-", None, False)
    got = (first["fr"], first["ring"] if variant == "on" else None, first["tracked"])
    if got != expected:
        raise BenchError(f"{variant} {workload}: TORCH_FR_BUFFER_SIZE, ring and sampling are {got}, not {expected}")
    return max(r["seconds"] for r in mine) / steps * 1e6


def measure(rounds: int, steps: dict[str, int], progress: Progress) -> dict[str, Any]:
    """One kernel, the variants in turns A B B A; then the sampler timed."""
    loops: dict[str, dict[str, list[float]]] = {v: {w: [] for w in WORKLOADS} for v in VARIANTS}
    progress("starting the kernel")
    kernel = Kernel()
    try:
        kernel.check_module("taas_magic")
        kernel.run("%load_ext taas_magic")
        for options in VARIANTS.values():  # warm-up
            kernel.run(loop_cell(options, steps["ddp"] // 10, steps["bare"] // 10), timeout=300)
        for round_number in range(rounds):
            order = list(VARIANTS) if round_number % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                kernel.wait_until_quiet()
                found = records(
                    kernel.run(loop_cell(VARIANTS[variant], steps["ddp"], steps["bare"]), timeout=600).stdout
                )
                for workload in WORKLOADS:
                    loops[variant][workload].append(loop(variant, found, workload, steps[workload]))
            progress(
                f"round {round_number + 1} of {rounds}: "
                + ", ".join(f"{v} {w} {loops[v][w][-1]:.0f} µs" for v in VARIANTS for w in WORKLOADS)
            )
        sampled = [r for r in records(kernel.run(SAMPLER_CELL, timeout=300).stdout) if r["workload"] == "sampler"]
        sampler = {
            kind: {"us": max(r["us"] for r in sampled if r["kind"] == kind), "ring": sampled[0]["ring"]}
            for kind in ("moved", "still")
        }
    finally:
        left = kernel.shutdown()
        if left:
            print(f"left behind and killed: {left}", file=sys.stderr)
    return {"loops": loops, "sampler": sampler}


def report(measured: dict[str, Any], rounds: int, steps: dict[str, int], results: Path) -> None:
    loops = measured["loops"]
    print(
        f"{RANKS} CPU ranks (gloo), one kernel, {rounds} rounds A B B A; times inside the ranks (the slower "
        "rank), µs a step"
    )
    ratios: dict[str, float] = {}
    for workload in WORKLOADS:
        on, off = loops["on"][workload], loops["off"][workload]
        pairs = [a / b for a, b in zip(on, off)]
        ratios[workload] = statistics.median(pairs)
        low, high = interval(pairs)
        print(f"{workload}: {steps[workload]} steps a cell")
        for variant, values in (("on", on), ("off", off)):
            print(
                f"  tracking {variant:3}  median {statistics.median(values):7.1f}  (min {min(values):7.1f}, "
                f"max {max(values):7.1f})"
            )
        print(
            f"  on / off: {ratios[workload]:.3f}x, the median of the {len(pairs)} pairs' ratios "
            f"(90% bootstrap interval {low:.3f}x to {high:.3f}x)"
        )
    sampler = measured["sampler"]
    print(
        f"activity.sample(), once a second in each rank (ring of {sampler['moved']['ring']}): "
        f"{sampler['moved']['us']:.0f} µs after a rank moved (the counters), {sampler['still']['us']:.0f} µs "
        f"when it did not (the whole ring): {sampler['still']['us'] / 1e6:.3%} of a core at most"
    )
    print_checks(
        [
            (
                ratios[w] <= TARGET,
                f"{w}: tracking costs {ratios[w] - 1:+.1%} of the loop's time (target <= {TARGET - 1:+.0%})",
            )
            for w in WORKLOADS
        ]
    )
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {"machine": machine_info(), "ranks": RANKS, "rounds": rounds, "steps": steps, "ratios": ratios, **measured},
            indent=1,
        )
        + "\n"
    )
    print(f"results: {shown(results)}")


def interval(pairs: list[float]) -> tuple[float, float]:
    """5th and 95th percentiles of the median ratio over pairs drawn again: the noise the verdict carries."""
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(pairs, k=len(pairs))) for _ in range(RESAMPLES))
    return medians[RESAMPLES // 20], medians[RESAMPLES - RESAMPLES // 20 - 1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16, help="rounds, each one cell of each variant (default 16)")
    parser.add_argument("--steps", type=int, default=500, help="DDP steps a cell (default 500: about 2 s here)")
    parser.add_argument(
        "--all-reduces", type=int, default=1500, help="bare all_reduces a cell (default 1500: about 1.5 s here)"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=ROOT / "benchmarks/results/hang_tracking.json",
        help="JSON output (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.steps, args.all_reduces) < 10:
        parser.error(
            f"--rounds must be at least 1 and --steps and --all-reduces at least 10, got "
            f"{args.rounds}, {args.steps} and {args.all_reduces}"
        )
    chosen = [name for name in USER_CHOICES if name in os.environ]
    if chosen:
        parser.error(
            f"{' and '.join(chosen)} is set here: the kernel would inherit it and taas would not size "
            "the ring; unset it to measure taas's default"
        )
    steps = {"ddp": args.steps, "bare": args.all_reduces}
    report(measure(args.rounds, steps, Progress()), args.rounds, steps, args.results)


if __name__ == "__main__":
    main()
