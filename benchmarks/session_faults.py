"""A session through a rank's death and a rank's error, beside what a user does without that: start it again.

A 4-rank CPU session trains a DDP model (three 1024x1024 layers with Adam: about 37 MB of state per rank). Each
round, one rank is killed with SIGKILL in the middle of training; taas puts a new process in its place and gives
it the others' common state (``rank/healing.py``). Measured: from the moment the rank killed itself to the end of
the cell (the new process healed), as the wall clock says; the state copy's rate, as the new process reports it;
and the next training cell's first steps run. Then one rank raises in the middle of training: from the raise to
the end of the cell (every rank released from its collective, the group connected anew). The alternative a user
has without healing: ``%taas stop`` and the cell that starts the session again (the model built, the group
joined, its training lost); its time is measured in the same kernel, in alternating rounds. And ``%taas resize``:
to half the ranks and back, each timed to the end of its line, the new ranks given the others' state. Last, the
same deaths in a session that trains on a registered loader its producers serve: the new process also takes over
the dead rank's share of the stream (``StandIn.take_over``).

Run: ``python benchmarks/session_faults.py`` (``--quick``: 3 rounds instead of 10). The target: healed within 5 s
of the death, and the state copied at 1 GB/s or more.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import time

from harness import ROOT, Kernel, Progress, arguments, machine_info, plot_axes, print_checks, save_plot, shown

RANKS = 4
HEAL_TARGET_S = 5.0
COPY_TARGET_MB_S = 1000.0
START = f"""#pragma taas --gpus {RANKS} --keep --start fork --return none
import os, time, signal, torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)]))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
model(torch.randn(8, 1024)).square().mean().backward()
optimizer.step()
"""
FAULT = """#pragma taas --return none
for step in range(1_000_000):
    if dist.get_rank() == {rank} and step == {step}:
        print("fault at", time.time(), flush=True)
        {how}
    model(torch.randn(8, 1024)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
# The same training over a registered loader that the session's producers serve: a rank killed mid-pass is
# replaced with its share of the stream (``StandIn.take_over``).
SERVED = """import torch, taas
from torch.utils.data import DataLoader, TensorDataset
batches = DataLoader(TensorDataset(torch.randn(2048, 1024)), batch_size=8, shuffle=True)
taas.register(batches)
"""
FAULT_SERVED = """#pragma taas --return none
step = 0
while True:
    for (x,) in batches:
        if dist.get_rank() == {rank} and step == {step}:
            print("fault at", time.time(), flush=True)
            {how}
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
"""
TRAIN = """#pragma taas --return none
for step in range(5):
    model(torch.randn(8, 1024)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
COPIED = re.compile(r"names copied from rank \d+ \(([\d.]+) MB in ([\d.]+) s\)")


def fault(kernel: Kernel, how: str, rng: random.Random, loop: str = FAULT) -> tuple[float, float | None]:
    """One rank raises or dies mid-training: (seconds from the fault to the cell's end, the copy's MB/s or None)."""
    code = loop.format(rank=rng.randrange(RANKS), step=rng.randrange(5, 30), how=how)
    cell = kernel.execute(code, timeout=120)
    ended = time.time()
    if cell.error is None:
        raise RuntimeError(f"the fault did not fail the cell: {cell.stdout}")
    said = re.search(r"fault at ([\d.]+)", cell.stdout)
    if said is None:
        raise RuntimeError(f"the faulting rank did not say when: {cell.stdout}")
    copied = COPIED.search(cell.stderr)
    rate = float(copied[1]) / max(float(copied[2]), 1e-3) if copied else None
    kernel.run(TRAIN)  # the session trains on (a session that ended refuses the cell: BenchError)
    return ended - float(said[1]), rate


def resize(kernel: Kernel, world: int, rates: list[float]) -> float:
    """``%taas resize WORLD``: seconds to the end of the line; the new ranks' copy rates join ``rates``; the
    session trains on."""
    started = time.time()
    cell = kernel.run(f"%taas resize {world}")
    took = time.time() - started
    rates += [float(mb) / max(float(seconds), 1e-3) for mb, seconds in COPIED.findall(cell.stderr)]
    kernel.run(TRAIN)
    return took


def restart(kernel: Kernel, start: str = START) -> float:
    """What a user does without healing: end the session and start it again (with ``start``)."""
    started = time.time()
    kernel.run("%taas stop")
    kernel.run(start, timeout=300)
    return time.time() - started


def main(argv: list[str] | None = None) -> None:
    args = arguments(
        __doc__ or "",
        "3 rounds instead of 10",
        ROOT / "benchmarks/results/session_faults.json",
        ROOT / "docs/images/session_faults.png",
        argv,
    )
    rounds = 3 if args.quick else 10
    progress, rng = Progress(), random.Random(7)
    kernel = Kernel()
    healed: list[float] = []
    released: list[float] = []
    rates: list[float] = []
    restarted: list[float] = []
    shrunk: list[float] = []
    grown: list[float] = []
    served: list[float] = []  # a rank killed while the session trains on a registered loader
    try:
        kernel.run("%load_ext taas_magic")
        kernel.run(START, timeout=300)
        for round_ in range(rounds):
            progress(f"round {round_ + 1} of {rounds}")
            seconds, rate = fault(kernel, "os.kill(os.getpid(), signal.SIGKILL)", rng)
            healed.append(seconds)
            rates += [rate] if rate is not None else []
            released.append(fault(kernel, "raise ValueError('bad batch')", rng)[0])
            restarted.append(restart(kernel))
            shrunk.append(resize(kernel, RANKS // 2, []))
            grown.append(resize(kernel, RANKS, rates))
        kernel.run("%taas stop")
        kernel.run(SERVED)
        kernel.run(START, timeout=300)
        for round_ in range(rounds):
            progress(f"round {round_ + 1} of {rounds}, training on a served loader")
            served.append(fault(kernel, "os.kill(os.getpid(), signal.SIGKILL)", rng, FAULT_SERVED)[0])
        kernel.run("%taas stop")
    finally:
        left = kernel.shutdown()
        if left:
            print(f"left behind and killed: {left}")
    report(healed, served, released, rates, restarted, (shrunk, grown), args.results, args.plot, rounds)


def report(
    healed: list[float],
    served: list[float],
    released: list[float],
    rates: list[float],
    restarted: list[float],
    resized: tuple[list[float], list[float]],
    results,
    plot,
    rounds: int,
) -> None:
    heal, release, restart_ = statistics.median(healed), statistics.median(released), statistics.median(restarted)
    rate = statistics.median(rates) if rates else 0.0
    print(f"a {RANKS}-rank CPU session with a DDP model and Adam (about 37 MB of state per rank), {rounds} rounds")
    print(f"{'':44} {'median':>8} {'max':>8}")
    print(f"{'a rank killed: death -> healed, cell over':44} {heal:7.2f} s {max(healed):6.2f} s")
    print(f"{'the same, training on a served loader':44} {statistics.median(served):7.2f} s {max(served):6.2f} s")
    print(f"{'a rank raised: raise -> group reconnected':44} {release:7.2f} s {max(released):6.2f} s")
    print(f"{'%taas stop + the session started again':44} {restart_:7.2f} s {max(restarted):6.2f} s")
    shrunk, grown = resized
    print(f"{f'%taas resize {RANKS // 2} (from {RANKS})':44} {statistics.median(shrunk):7.2f} s {max(shrunk):6.2f} s")
    print(f"{f'%taas resize {RANKS} (from {RANKS // 2})':44} {statistics.median(grown):7.2f} s {max(grown):6.2f} s")
    print(f"state copied to a new process (healed or joined): {rate:.0f} MB/s (median)")
    print(f"starting again / healing: {restart_ / heal:.1f}x")
    print_checks(
        [
            (heal <= HEAL_TARGET_S, f"healed {heal:.2f} s after the death (target <= {HEAL_TARGET_S:g} s)"),
            (rate >= COPY_TARGET_MB_S, f"state copied at {rate:.0f} MB/s (target >= {COPY_TARGET_MB_S:g} MB/s)"),
        ]
    )
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "ranks": RANKS,
                "rounds": rounds,
                "healed_s": healed,
                "healed_serving_a_loader_s": served,
                "released_s": released,
                "copy_mb_s": rates,
                "restarted_s": restarted,
                "resized_down_s": shrunk,
                "resized_up_s": grown,
            },
            indent=1,
        )
        + "\n"
    )
    figure, axes = plot_axes(7, 3.8)
    axes.boxplot(
        [healed, served, released, shrunk, grown, restarted],
        orientation="horizontal",
        showfliers=False,
        tick_labels=[
            "rank killed: healed",
            "… on a served loader",
            "rank raised: released",
            f"resize {RANKS} -> {RANKS // 2}",
            f"resize {RANKS // 2} -> {RANKS}",
            "stop + start again",
        ],
    )
    axes.axvline(HEAL_TARGET_S, color="tab:red", linestyle="--", linewidth=1, label=f"target {HEAL_TARGET_S:g} s")
    axes.set_xlabel(f"seconds until the session trains on ({RANKS} CPU ranks)")
    axes.legend(loc="lower right")
    save_plot(figure, plot)
    print(f"results: {shown(results)}; plot: {shown(plot)}")


if __name__ == "__main__":
    main()
