"""How fast registered loaders reach the ranks: taas data delivery against a DataLoader in each rank.

The data. A map-style dataset whose ``__getitem__`` sleeps 5 ms (slow storage) and returns a
100 KB float32 tensor (25,600 elements) filled with its index, and the index; batches of 32,
so one batch costs one fetching process about 160 ms. The consumer in each rank checks every
batch (shape, dtype, that row j holds sample j's values) and then sleeps 2 ms, a stand-in for
a training step. It sleeps rather than spins: on 2 cores two spinning ranks would take the
cores from the processes that fetch, and the figures would measure the scheduler.

Contenders, in the same kernel, interleaved, as 2-rank taas cells (ranks forked the same way):
  taas   the loader registered with ``taas.register`` (``num_workers=0``: each producer fetches
         serially; a producer runs the registered loader's own workers if it has any), the cell
         headed ``--cpus K``: K producer processes for the whole job
  plain  what a user writes instead, in a ``--cpus 0`` cell: in each rank
         ``DataLoader(dataset, batch_size=32, sampler=DistributedSampler(...), num_workers=K)``:
         K worker processes per rank, so 2K for the job

Scenarios:
  sweep      K = 1, 2, 4, 8; throughput, wait share, time to the first batch
  head start K = 4; each rank sleeps 2 s before it iterates (the producers start with the cell
             and fill their buffer meanwhile; a DataLoader's workers start only at ``iter()``)
  outpace    K = 8 and an 80 ms step instead of 2 ms: the only setting here where fetching is
             faster than consuming (at 2 ms per step it would take some 80 fetchers per rank),
             so the wait share measures what delivery costs a rank when data is ready
  transport  an instant dataset (no sleep), 100 KB or 16-float samples, no step, 1 rank with
             one fetching process either way (``--cpus 1`` against ``num_workers=1``): the
             cost per batch of getting it from another process

What is measured, inside the ranks with ``time.monotonic()`` (one clock for every process):
throughput is the batches of all ranks over the time from the first rank's ``iter()`` to the
last rank's end of loop; wait share is the time spent in ``next()`` over the loop's time
(mean of the ranks), also after the first batch alone; time to the first batch is from
``iter()`` to the first batch in the slowest rank. Every figure is a median over repetitions:
the machine is shared and noisy. Targets are printed as PASS/FAIL lines, never asserted.
Figures go to benchmarks/results/data_delivery.json, the plot to docs/images/data_delivery.png.

    python benchmarks/data_delivery.py            # about 5 minutes on 2 cores
    python benchmarks/data_delivery.py --quick    # shorter passes, fewer repetitions: about 2 minutes
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from harness import (
    ROOT,
    BenchError,
    Cell,
    Kernel,
    Progress,
    arguments,
    kill,
    machine_info,
    print_checks,
    shown,
)

RESULTS = ROOT / "benchmarks" / "results" / "data_delivery.json"
PLOT = ROOT / "docs" / "images" / "data_delivery.png"

RANKS = 2
BATCH = 32
SAMPLE_SLEEP = 0.005  # seconds per sample: slow storage
SAMPLE_NUMEL = 25_600  # float32: 100 KB
TINY_NUMEL = 16
STEP = 0.002  # seconds of "training" per batch in each rank
SLOW_STEP = 0.080  # the outpace scenario's step
HEAD_START = 2.0  # seconds a rank sleeps before iterating, in the head-start scenario
SWEEP = (1, 2, 4, 8)
HEAD_K = 4
OUTPACE_K = 8
MARKER = "taas-bench-rank"

# Targets
SCALING_TARGET = 3.2  # --cpus 4 against --cpus 1
PARITY_TARGET = 0.9  # taas against plain at equal K
WAIT_TARGET = 0.05  # wait share after the first batch, when fetching outpaces consuming
FIRST_BATCH_TARGET = 0.020  # seconds, with a head start: "near zero" next to ~160 ms for one batch


@dataclass(frozen=True)
class Settings:
    repetitions: int
    sweep_batches: int  # batches in one pass of the sweep's loader (all ranks together)
    short_batches: int  # for head start and outpace
    instant_batches: int  # for transport


FULL = Settings(repetitions=5, sweep_batches=48, short_batches=32, instant_batches=100)
QUICK = Settings(repetitions=3, sweep_batches=32, short_batches=16, instant_batches=40)


_LEFT_BEHIND: list[str] = []  # command lines of processes that outlived their cell or kernel


# -- the cells ---------------------------------------------------------------------------------
def setup_cell(settings: Settings) -> str:
    """Datasets, and one registered loader over each: the kernel's state before any measurement."""
    return textwrap.dedent(f"""\
        %load_ext taas_magic
        import time, torch, taas
        from torch.utils.data import DataLoader, Dataset

        class Storage(Dataset):
            '''Sample i: a float32 tensor filled with i, and i; each read takes ``delay`` seconds.'''
            def __init__(self, length, delay, numel):
                self.length, self.delay, self.numel = length, delay, numel
            def __len__(self):
                return self.length
            def __getitem__(self, i):
                if self.delay:
                    time.sleep(self.delay)
                return torch.full((self.numel,), float(i)), i

        datasets = dict(
            sweep=Storage({settings.sweep_batches * BATCH}, {SAMPLE_SLEEP}, {SAMPLE_NUMEL}),
            short=Storage({settings.short_batches * BATCH}, {SAMPLE_SLEEP}, {SAMPLE_NUMEL}),
            big=Storage({settings.instant_batches * BATCH}, 0, {SAMPLE_NUMEL}),
            tiny=Storage({settings.instant_batches * BATCH}, 0, {TINY_NUMEL}),
        )
        torch.manual_seed(0)
        sweep, short, big, tiny = (DataLoader(datasets[name], batch_size={BATCH}, shuffle=True)
                                   for name in ("sweep", "short", "big", "tiny"))
        for registered in (sweep, short, big, tiny):
            taas.register(registered)
    """)


@dataclass(frozen=True)
class Case:
    """One cell to measure: who delivers, from which data, with how many fetching processes."""

    scenario: str  # "sweep", "head start", "outpace", "transport big", "transport tiny"
    contender: str  # "taas" or "plain"
    data: str  # the dataset, and the name of the registered loader over it
    k: int  # --cpus for taas; num_workers in each rank for plain
    ranks: int = RANKS
    step: float = STEP
    head: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.scenario}/{self.contender}/{self.k}"


def source_expression(case: Case) -> str:
    """What the rank iterates: the registered loader's name (taas) or a loader built in the rank."""
    if case.contender == "taas":
        return case.data
    return (
        f"_DataLoader(datasets[{case.data!r}], batch_size={BATCH}, num_workers={case.k}, "
        f"sampler=_DistributedSampler(datasets[{case.data!r}], num_replicas=_taas.world_size(), "
        f"rank=_taas.rank(), shuffle=True))"
    )


RANK_LOOP = """\
import json as _json, time as _time, torch as _torch, taas as _taas
from torch.utils.data import DataLoader as _DataLoader
from torch.utils.data.distributed import DistributedSampler as _DistributedSampler
_source = {source}
_time.sleep({head})
_waits, _count = [], 0
_began = _time.monotonic()
_batches = iter(_source)
while True:
    _asked = _time.monotonic()
    try:
        _x, _i = next(_batches)
    except StopIteration:
        break
    _waits.append(_time.monotonic() - _asked)
    if _x.shape != ({batch}, {numel}) or _x.dtype != _torch.float32 or not _torch.equal(_x[:, -1], _i.float()):
        raise ValueError(f"batch {{_count}}: got {{tuple(_x.shape)}} {{_x.dtype}} for samples {{_i.tolist()}}")
    _time.sleep({step})
    _count += 1
_ended = _time.monotonic()
print({marker!r}, _json.dumps(dict(rank=_taas.rank(), count=_count, began=_began, ended=_ended,
      first=_waits[0], waited=sum(_waits))), flush=True)
"""


def cell_code(case: Case) -> str:
    cpus = case.k if case.contender == "taas" else 0
    header = f"#pragma taas --gpus {case.ranks} --device cpu --cpus {cpus} --output all --return none\n"
    numel = TINY_NUMEL if case.data == "tiny" else SAMPLE_NUMEL
    return header + RANK_LOOP.format(
        source=source_expression(case), head=case.head, batch=BATCH, numel=numel, step=case.step, marker=MARKER
    )


# -- one measurement ---------------------------------------------------------------------------
@dataclass
class Sample:
    """One cell's figures, from what its ranks printed."""

    batches: int
    seconds: float  # first rank's iter() to last rank's end of loop
    batches_per_second: float
    wait_share: float  # time in next() / loop time, mean of the ranks
    wait_share_after_first: float  # the same from the first batch on
    first_batch: float  # iter() to the first batch, slowest rank
    ms_per_batch: float  # a rank's loop time per batch, mean of the ranks
    cell_seconds: float  # kernel busy -> idle
    summary: str | None  # taas's own summary line on stderr


def sample_of(case: Case, cell: Cell) -> Sample:
    ranks = [json.loads(line.split(MARKER, 1)[1]) for line in cell.stdout.splitlines() if MARKER in line]
    if sorted(r["rank"] for r in ranks) != list(range(case.ranks)):
        raise BenchError(f"{case.key}: expected a record from each of {case.ranks} ranks, got:\n{cell.stdout}")
    delivered = "elements delivered" in cell.stderr
    if delivered != (case.contender == "taas"):
        raise BenchError(f"{case.key}: taas delivery {'ran' if delivered else 'did not run'}:\n{cell.stderr}")
    batches = sum(r["count"] for r in ranks)
    seconds = max(r["ended"] for r in ranks) - min(r["began"] for r in ranks)
    loops = [r["ended"] - r["began"] for r in ranks]
    after_first = [(r["waited"] - r["first"]) / max(r["ended"] - r["began"] - r["first"], 1e-9) for r in ranks]
    return Sample(
        batches=batches,
        seconds=seconds,
        batches_per_second=batches / seconds,
        wait_share=statistics.mean(r["waited"] / loop for r, loop in zip(ranks, loops)),
        wait_share_after_first=statistics.mean(after_first),
        first_batch=max(r["first"] for r in ranks),
        ms_per_batch=1000 * statistics.mean(loop / r["count"] for r, loop in zip(ranks, loops)),
        cell_seconds=cell.kernel_seconds,
        summary=_summary_line(cell.stderr),
    )


def _summary_line(stderr: str) -> str | None:
    found = re.search(r"taas: \w+: \d+ elements delivered.*", stderr)
    return found[0] if found else None


def measure(kernel: Kernel, case: Case) -> Sample:
    sample = sample_of(case, kernel.run(cell_code(case)))
    _check_nothing_left(kernel, case)
    return sample


def _check_nothing_left(kernel: Kernel, case: Case, grace: float = 5.0) -> None:
    """A cell's ranks, producers and workers end with it; whatever is still alive after ``grace`` is killed."""
    deadline = time.monotonic() + grace
    while kernel.run_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = kill(kernel.run_processes())
    _LEFT_BEHIND.extend(f"{case.key}: {line}" for line in left)


# -- the scenarios -----------------------------------------------------------------------------
def cases() -> list[Case]:
    """Every cell of one repetition, contenders side by side, so drifting load hits both alike."""
    found = []
    for k in SWEEP:
        found += [Case("sweep", "taas", "sweep", k), Case("sweep", "plain", "sweep", k)]
    for contender in ("taas", "plain"):
        found.append(Case("head start", contender, "short", HEAD_K, head=HEAD_START))
        found.append(Case("outpace", contender, "short", OUTPACE_K, step=SLOW_STEP))
    for data in ("big", "tiny"):
        found += [Case(f"transport {data}", contender, data, 1, ranks=1, step=0.0) for contender in ("taas", "plain")]
    return found


Samples = dict[str, list[Sample]]  # case key -> one sample per repetition


def warm_up(kernel: Kernel) -> None:
    """One unmeasured cell per contender: the first run of each path pays one-time costs (imports, caches)."""
    for contender in ("taas", "plain"):
        kernel.run(cell_code(Case("warm-up", contender, "tiny", 1, ranks=RANKS, step=0.0)))
    kernel.wait_until_quiet()


def run_all(settings: Settings, progress: Callable[[str], None]) -> Samples:
    samples: Samples = {}
    kernel = Kernel()
    try:
        kernel.run(setup_cell(settings))
        kernel.wait_until_quiet()
        warm_up(kernel)
        for repetition in range(settings.repetitions):
            for case in cases():
                samples.setdefault(case.key, []).append(measure(kernel, case))
            progress(f"repetition {repetition + 1}/{settings.repetitions}")
    finally:
        _LEFT_BEHIND.extend(kernel.shutdown())
    return samples


# -- figures -----------------------------------------------------------------------------------
def median(samples: Samples, key: str, figure: str) -> float:
    return statistics.median(getattr(s, figure) for s in samples[key])


def ideal_rate(k: int, contender: str) -> float:
    """Batches/s if storage were the only limit: each fetching process reads one sample at a time."""
    fetchers = k if contender == "taas" else RANKS * k
    return fetchers / (BATCH * SAMPLE_SLEEP)


def sweep_table(samples: Samples) -> str:
    head = (
        f"{'K':>2} {'':<6}{'batches/s':>10}{'/ storage':>10}{'wait':>7}{'after 1st':>10}{'1st batch':>11}"
        f"{'cell s':>8}   {'taas / plain':>12}"
    )
    lines = [f"sweep: {RANKS} ranks, 5 ms per sample, {BATCH} per batch, 2 ms step (medians)", head, "-" * len(head)]
    lines += [_sweep_row(samples, contender, k) for k in SWEEP for contender in ("taas", "plain")]
    lines.append(
        "/ storage: against K (taas) or 2K (plain) processes each reading one sample at a time, nothing else in the way"
    )
    return "\n".join(lines)


def _sweep_row(samples: Samples, contender: str, k: int) -> str:
    key = f"sweep/{contender}/{k}"
    rate = median(samples, key, "batches_per_second")
    row = (
        f"{k:>2} {contender:<6}{rate:>10.1f}{rate / ideal_rate(k, contender):>9.0%} "
        f"{median(samples, key, 'wait_share'):>6.0%}{median(samples, key, 'wait_share_after_first'):>10.0%}"
        f"{1000 * median(samples, key, 'first_batch'):>8.0f} ms{median(samples, key, 'cell_seconds'):>8.2f}"
    )
    if contender == "taas":
        row += f"   {rate / median(samples, f'sweep/plain/{k}', 'batches_per_second'):>11.2f}x"
    return row


def other_tables(samples: Samples) -> str:
    lines = []
    for contender in ("taas", "plain"):
        key = f"head start/{contender}/{HEAD_K}"
        lines.append(
            f"head start ({HEAD_START:.0f} s, K={HEAD_K}), {contender:<5}: first batch "
            f"{1000 * median(samples, key, 'first_batch'):6.1f} ms"
        )
    for contender in ("taas", "plain"):
        key = f"outpace/{contender}/{OUTPACE_K}"
        lines.append(
            f"outpace ({SLOW_STEP * 1000:.0f} ms step, K={OUTPACE_K}), {contender:<5}: "
            f"{median(samples, key, 'batches_per_second'):5.1f} batches/s, wait "
            f"{median(samples, key, 'wait_share'):.1%}, after the first batch "
            f"{median(samples, key, 'wait_share_after_first'):.1%}"
        )
    for data, what in (("big", f"{BATCH} x 100 KB"), ("tiny", f"{BATCH} x {TINY_NUMEL} floats")):
        taas_ms = median(samples, f"transport {data}/taas/1", "ms_per_batch")
        plain_ms = median(samples, f"transport {data}/plain/1", "ms_per_batch")
        lines.append(
            f"transport, instant data, 1 rank, 1 fetcher, {what:<16}: taas {taas_ms:6.2f} ms/batch, "
            f"plain {plain_ms:6.2f} ms/batch, {taas_ms / plain_ms:.2f}x"
        )
    return "\n".join(lines)


def equal_fetchers_line(samples: Samples) -> str:
    """Not a target: the same number of fetching processes, --cpus 2K against num_workers=K in 2 ranks."""
    parts = []
    for k in SWEEP:
        if 2 * k in SWEEP:
            ratio = median(samples, f"sweep/taas/{2 * k}", "batches_per_second") / median(
                samples, f"sweep/plain/{k}", "batches_per_second"
            )
            parts.append(f"--cpus {2 * k} / num_workers={k}: {ratio:.2f}x")
    return f"equal fetching processes (taas / plain): {', '.join(parts)}"


def checks(samples: Samples) -> list[tuple[bool, str]]:
    """Each target with the figures it was judged on."""
    rate = {(c, k): median(samples, f"sweep/{c}/{k}", "batches_per_second") for c in ("taas", "plain") for k in SWEEP}
    scaling = rate["taas", 4] / rate["taas", 1]
    parity = {k: rate["taas", k] / rate["plain", k] for k in SWEEP}
    wait = median(samples, f"outpace/taas/{OUTPACE_K}", "wait_share_after_first")
    first = median(samples, f"head start/taas/{HEAD_K}", "first_batch")
    scaling_text = (
        f"--cpus 4 >= {SCALING_TARGET}x --cpus 1: {scaling:.2f}x "
        f"({rate['taas', 4]:.1f} / {rate['taas', 1]:.1f} batches/s)"
    )
    parity_text = f"taas >= {PARITY_TARGET}x plain DataLoader at equal K: " + ", ".join(
        f"K={k} {p:.2f}x" for k, p in parity.items()
    )
    wait_text = (
        f"wait share < {WAIT_TARGET:.0%} once producers outpace the consumers "
        f"(K={OUTPACE_K}, {SLOW_STEP * 1000:.0f} ms step, after the first batch): {wait:.1%}"
    )
    first_text = (
        f"first batch <= {FIRST_BATCH_TARGET * 1000:.0f} ms after a {HEAD_START:.0f} s head start "
        f"(K={HEAD_K}): {first * 1000:.1f} ms"
    )
    return [
        (scaling >= SCALING_TARGET, scaling_text),
        (all(p >= PARITY_TARGET for p in parity.values()), parity_text),
        (wait < WAIT_TARGET, wait_text),
        (first <= FIRST_BATCH_TARGET, first_text),
    ]


# -- results -----------------------------------------------------------------------------------
FIGURES = ("batches_per_second", "wait_share", "wait_share_after_first", "first_batch", "ms_per_batch", "cell_seconds")


def write_results(
    path: Path, info: dict, settings: Settings, samples: Samples, found: list[tuple[bool, str]], seconds: float
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": info,
        "settings": {
            **asdict(settings),
            "ranks": RANKS,
            "batch_size": BATCH,
            "sample_sleep_s": SAMPLE_SLEEP,
            "sample_numel": SAMPLE_NUMEL,
            "step_s": STEP,
            "slow_step_s": SLOW_STEP,
            "head_start_s": HEAD_START,
            "consumer": "time.sleep after checking each batch",
        },
        "timing": "inside the ranks, time.monotonic(): first rank's iter() to last rank's end of loop",
        "medians": {key: {figure: median(samples, key, figure) for figure in FIGURES} for key in samples},
        "samples": {key: [asdict(s) for s in values] for key, values in samples.items()},
        "checks": [{"passed": ok, "check": text} for ok, text in found],
        "left_behind": list(_LEFT_BEHIND),
        "benchmark_seconds": round(seconds, 1),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


# -- plot --------------------------------------------------------------------------------------
STYLES = {
    "taas": ("taas delivery, --cpus K (K producers)", "#1f77b4", "o"),
    "plain": ("DataLoader in each rank, num_workers=K (2K workers)", "#ff7f0e", "s"),
}


def plot(path: Path, samples: Samples, info: dict) -> None:
    """Throughput and wait share against K (what a user tunes), first batch and cost per batch beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(12, 9), dpi=120, gridspec_kw={"height_ratios": [3, 2]})
    _throughput(axes[0][0], samples)
    _wait_share(axes[0][1], samples)
    _first_batch(axes[1][0], samples)
    _transport(axes[1][1], samples)
    figure.suptitle(
        f"Data delivery to {RANKS} CPU ranks: taas --cpus K against a DataLoader(num_workers=K) in each rank\n"
        f"{info['usable_cores']} cores, torch {info['torch']}, {info['date'][:10]}; medians of "
        f"{len(next(iter(samples.values())))} repetitions",
        fontsize=11,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def _k_axis(axes) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(SWEEP, [str(k) for k in SWEEP])
    axes.set_xlim(0.8, 11)
    axes.set_xlabel("K")
    axes.grid(alpha=0.3)


def _throughput(axes, samples: Samples) -> None:
    for contender, (label, colour, marker) in STYLES.items():
        keys = [f"sweep/{contender}/{k}" for k in SWEEP]
        rates = [median(samples, key, "batches_per_second") for key in keys]
        low = [r - min(s.batches_per_second for s in samples[key]) for r, key in zip(rates, keys)]
        high = [max(s.batches_per_second for s in samples[key]) - r for r, key in zip(rates, keys)]
        axes.errorbar(SWEEP, rates, yerr=[low, high], label=label, color=colour, marker=marker, capsize=3)
        axes.plot(
            SWEEP,
            [ideal_rate(k, contender) for k in SWEEP],
            color=colour,
            linestyle=":",
            linewidth=1,
            label=f"storage limit: {'K' if contender == 'taas' else '2K'} readers x 1 sample per 5 ms",
        )
        for k, rate in zip(SWEEP, rates):
            axes.annotate(
                f"{rate:.1f}", (k, rate), textcoords="offset points", xytext=(7, -9), fontsize=8, color=colour
            )
    _k_axis(axes)
    axes.set_ylabel("batches/s, both ranks (whiskers: min-max)")
    axes.set_title(f"Throughput: 5 ms per 100 KB sample, batches of {BATCH}, 2 ms step", fontsize=10)
    axes.legend(fontsize=8, loc="upper left")


def _wait_share(axes, samples: Samples) -> None:
    for contender, (_, colour, marker) in STYLES.items():
        shares = [100 * median(samples, f"sweep/{contender}/{k}", "wait_share") for k in SWEEP]
        axes.plot(SWEEP, shares, color=colour, marker=marker, label=f"{contender}, 2 ms step")
        share = 100 * median(samples, f"outpace/{contender}/{OUTPACE_K}", "wait_share_after_first")
        axes.scatter(
            [OUTPACE_K],
            [share],
            color=colour,
            marker=marker,
            facecolors="none",
            s=70,
            zorder=3,
            label=f"{contender}, {SLOW_STEP * 1000:.0f} ms step, after the 1st batch",
        )
    axes.axhline(100 * WAIT_TARGET, color="#2ca02c", linestyle="--", linewidth=1, label="target once data outpaces")
    _k_axis(axes)
    axes.set_ylim(-3, 103)
    axes.set_ylabel("time in next(), % of the loop")
    axes.set_title("Wait share of the ranks", fontsize=10)
    axes.legend(fontsize=8, loc="lower left")


def _bars(axes, groups: list[str], values: dict[str, list[float]], unit: str) -> None:
    """Grouped bars, taas beside plain in each group, each labelled with its value."""
    width = 0.38
    for index, (contender, (_, colour, _)) in enumerate(STYLES.items()):
        xs = [g + (index - 0.5) * width for g in range(len(groups))]
        bars = axes.bar(xs, values[contender], width * 0.92, color=colour, label=contender)
        axes.bar_label(bars, [f"{v:.1f} {unit}" for v in values[contender]], fontsize=8, padding=2)
    axes.set_xticks(range(len(groups)), groups, fontsize=9)
    axes.set_ylim(top=axes.get_ylim()[1] * 1.15)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=8, loc="upper right")


def _first_batch(axes, samples: Samples) -> None:
    keys = (f"sweep/{{}}/{HEAD_K}", f"head start/{{}}/{HEAD_K}")
    values = {c: [1000 * median(samples, key.format(c), "first_batch") for key in keys] for c in STYLES}
    _bars(
        axes,
        [f"K={HEAD_K}, ranks iterate at once", f"K={HEAD_K}, ranks iterate after {HEAD_START:.0f} s"],
        values,
        "ms",
    )
    axes.set_ylabel("ms from iter(), slowest rank")
    axes.set_title("Time to the first batch", fontsize=10)


def _transport(axes, samples: Samples) -> None:
    groups = ("big", "tiny")
    values = {c: [median(samples, f"transport {g}/{c}/1", "ms_per_batch") for g in groups] for c in STYLES}
    _bars(axes, [f"{BATCH} x 100 KB", f"{BATCH} x {TINY_NUMEL} floats"], values, "ms")
    axes.set_ylabel("ms per batch")
    axes.set_title("Cost per batch, instant data: 1 rank, 1 fetching process, no step", fontsize=10)


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, "shorter passes, fewer repetitions (about 2 minutes)", RESULTS, PLOT, argv)
    settings = QUICK if args.quick else FULL
    progress = Progress()
    samples = run_all(settings, progress)
    info = {**machine_info(), "load_average_at_end": os.getloadavg()}
    found = checks(samples)
    print(sweep_table(samples))
    print()
    print(other_tables(samples))
    print(equal_fetchers_line(samples))
    print()
    print_checks(found)
    print(f"processes left behind: {len(_LEFT_BEHIND) or 'none'}")
    elapsed = progress.elapsed()
    write_results(args.results, info, settings, samples, found, elapsed)
    plot(args.plot, samples, info)
    print(f"wrote {shown(args.results)} and {shown(args.plot)} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
