"""Cluster runs: a taas cell against Ray Train's TorchTrainer on the same Ray cluster, in one run.

The cluster. A real Ray cluster on this machine (``taas_magic.local_cluster``): a c1.4 head and
two t.2 nodes (2 logical GPUs, 2 CPUs each), every raylet on its own loopback address, no
dashboard, no usage report. Both contenders run the same 2 nodes x 2 ranks on CPU over gloo.

The job. Every rank joins the process group, all-reduces one number and leaves:
``init_process_group("gloo")``, ``all_reduce``, ``destroy_process_group``.

Contenders:
  taas cold    a taas cell (``#!t.2`` + ``--gpus 4 --device cpu``) in a kernel connected with
               TAAS_CLUSTER, right after ``%taas cluster release``: the agents and their fork
               servers (which import torch) start first. Client round trip of the cell.
  taas warm    the same cell again: the agents are warm. Client round trip.
  TorchTrainer ``TorchTrainer(job, ScalingConfig(num_workers=4, ...)).fit()`` from this process
               (a Ray driver), each worker holding 1 CPU and half a t.2 node, so 2 per node, as
               taas places them. Ray Train has no warm mode: every fit starts its workers anew.

Bandwidth: the same contenders all-reduce a 16 MB float32 tensor 20 times after 3 rounds of
warm-up; rank 0 reports the algorithm bandwidth (bytes per rank / time per all-reduce).

Data delivery: a map-style dataset whose ``__getitem__`` sleeps 5 ms (slow storage) and returns
a 100 KB tensor; batches of 32, 32 batches per pass, 2 passes; each rank checks every batch and
sleeps 2 ms per step. Both contenders have 4 fetching processes for the job:
  taas delivery  the loader registered (``num_workers=4``), ``--cpus 1``: its producer and its 4
                 workers run on the c1.4 node; each t.2 node's agent relays its ranks' batches
  plain loader   what a user writes instead, in a ``--cpus 0`` cell: in each rank a DataLoader
                 with a DistributedSampler and ``num_workers=1``
Relay: what crossing nodes costs, with an instant dataset (no sleep, no step, ``num_workers=0``,
batches of 3.2 MB, 8 passes of 32) and one producer, taking turns in each round:
  relay, 2 nodes      4 ranks on the two t.2 nodes, the producer on the c1.4 node: every batch
                      streamed from the c1.4 node's agent to a t.2 node's agent
  one machine, 4      the same cell with ``--on local``: producer and ranks on this machine
  relay, 1 node       2 ranks on one t.2 node (``--gpus 2``), the producer on the c1.4 node: the
                      whole stream into one node's ranks
  one machine, 2      that cell with ``--on local``
Throughput is the job's batches over the time from the first rank's ``iter()`` to the last rank's
end; all nodes are this machine, so one clock serves. CPU per batch three ways: the whole
machine's busy time over that span (``/proc/stat``: every process, other users' too), the agents'
CPU time over the whole cell (what relaying costs them, whatever else runs), and the ranks' own.

Medians over repetitions; the machine is shared and noisy. Targets (from the project's issues)
are printed as PASS/FAIL lines, never asserted: warm taas <= 0.05x TorchTrainer, cold <= 0.3x,
bandwidth >= 0.95x; relayed across nodes >= 0.8x the batches/s of one machine (4 ranks), and
>= 1 GB/s of batches into one node's ranks. Figures go to benchmarks/results/cluster.json, the
plot to docs/images/cluster.png.

    python benchmarks/cluster.py              # about 5 minutes on 2 cores
    python benchmarks/cluster.py --quick      # fewer repetitions: about 3 minutes
    python benchmarks/cluster.py --delivery   # data delivery alone: about 2 minutes; the
                                              # launch figures are kept from the results file
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import harness

CONFIG = "configurations:\n  t.2: {cpus: 2, gpus: 2, memory_gb: 4}\n"
TARGETS = {"warm": 0.05, "cold": 0.3, "bandwidth": 0.95, "relay": 0.8, "node GB/s": 1.0}
DELIVERY_KEYS = ("taas delivery", "plain loader")
RELAY_KEYS = ("relay, 2 nodes", "one machine, 4", "relay, 1 node", "one machine, 2")
BATCH_BYTES = 32 * 25600 * 4 + 32 * 8  # one batch's tensors: 32 x 100 KB of float32, 32 int64 indices

JOB = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)
dist.destroy_process_group()
"""

BANDWIDTH = """\
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(4 * 1024 * 1024)  # 16 MB of float32
for _ in range(3):
    dist.all_reduce(x)
dist.barrier()
began = time.perf_counter()
for _ in range(20):
    dist.all_reduce(x)
dist.barrier()
seconds = (time.perf_counter() - began) / 20
gbps = x.numel() * x.element_size() / seconds / 1e9
dist.destroy_process_group()
"""

CELL = "#!t.2\n#pragma taas --gpus 4 --device cpu --return none\n"

DATASETS = """\
import time, torch, taas
from torch.utils.data import DataLoader, Dataset, DistributedSampler
class Samples(Dataset):
    def __init__(self, seconds):
        self.seconds = seconds
    def __len__(self):
        return 1024
    def __getitem__(self, i):
        if self.seconds:
            time.sleep(self.seconds)
        return torch.full((25600,), float(i)), i
slow = DataLoader(Samples(0.005), batch_size=32, shuffle=True, num_workers=4)
instant = DataLoader(Samples(0), batch_size=32, shuffle=True)
taas.register(slow)
taas.register(instant)
"""

CONSUME = """\
import time
def busy():
    fields = [int(f) for f in open("/proc/stat").readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # every CPU's time but idle and iowait, in ticks
began, waited, batches, ticks = time.monotonic(), 0.0, 0, busy()
for _ in range(PASSES):
    it = iter(LOADER)
    while True:
        asked = time.monotonic()
        try:
            values, indices = next(it)
        except StopIteration:
            break
        waited += time.monotonic() - asked
        assert values.shape == (32, 25600) and bool((values[:, 0] == indices.float()).all())
        batches += 1
        time.sleep(STEP)
import resource
usage = resource.getrusage(resource.RUSAGE_SELF)
print("DELIVERED", batches, began, time.monotonic(), waited, ticks, busy(), usage.ru_utime + usage.ru_stime)
"""

PLAIN = (
    "LOADER = DataLoader(slow.dataset, batch_size=32, num_workers=1,\n"
    "                    sampler=DistributedSampler(slow.dataset, taas.world_size(), taas.rank()))\n"
)


def make_job(body: str) -> Any:
    """``body`` as a Ray Train worker function that reports the bandwidth, when it measured one."""
    # Ray Train makes and ends the process group itself
    body = body.replace('dist.init_process_group("gloo")\n', "").replace("dist.destroy_process_group()\n", "")
    # Ray Train keeps reported metrics only with a checkpoint: rank 0 writes its figure to a file
    # (every node of this cluster is this machine)
    source = (
        "def job(config):\n"
        + textwrap.indent(body, "    ")
        + textwrap.indent(
            "if dist.get_rank() == 0 and 'gbps' in locals():\n    open(config['out'], 'w').write(str(gbps))\n", "    "
        )
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, "<job>", "exec"), namespace)
    return namespace["job"]


def torch_trainer(body: str, storage: str) -> tuple[float, float]:
    """One TorchTrainer fit of ``body`` on the t.2 nodes: (seconds, rank 0's reported bandwidth)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = os.path.join(storage, f"gbps-{time.monotonic_ns()}")
    os.makedirs(storage, exist_ok=True)
    trainer = TorchTrainer(
        make_job(body),
        train_loop_config={"out": out},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=4, use_gpu=False, resources_per_worker={"CPU": 1, "taas:t.2": 0.5}),
        run_config=RunConfig(storage_path=storage, name=f"bench-{time.monotonic_ns()}"),
    )
    began = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - began
    return seconds, float(Path(out).read_text()) if os.path.exists(out) else 0.0


def taas_cell(kernel: harness.Kernel, body: str) -> tuple[float, float]:
    cell = kernel.run(CELL + body + ("print('GBPS', gbps)\n" if "gbps" in body else ""), timeout=600)
    gbps = [
        float(line.split("GBPS ")[1]) for line in cell.stdout.splitlines() if "GBPS " in line and "[rank 0]" in line
    ]
    return cell.client_seconds, gbps[0] if gbps else 0.0


def delivered(kernel: harness.Kernel, header: str, body: str, ranks: int) -> tuple[float, float, float, dict]:
    """Run a delivery cell: (the job's batches per second, the ranks' mean share of time waiting,
    the machine's busy CPU seconds per batch over the same span, and CPU seconds per batch of the
    agents (over the whole cell) and of the ranks)."""
    agents = agents_cpu()
    cell = kernel.run(header + body, timeout=600)
    agents = agents_cpu() - agents
    rows = [line.split("DELIVERED ")[1].split() for line in cell.stdout.splitlines() if "DELIVERED " in line]
    if len(rows) != ranks:
        raise harness.BenchError(f"expected {ranks} ranks' figures, got {rows}: {cell.stdout[-2000:]}")
    batches = sum(int(row[0]) for row in rows)
    span = max(float(row[2]) for row in rows) - min(float(row[1]) for row in rows)
    waited = statistics.mean(float(row[3]) / (float(row[2]) - float(row[1])) for row in rows)
    first = min(rows, key=lambda row: float(row[1]))
    last = max(rows, key=lambda row: float(row[2]))
    cpu = (int(last[5]) - int(first[4])) / os.sysconf("SC_CLK_TCK")
    own = {"agents": agents / batches, "ranks": sum(float(row[6]) for row in rows) / batches}
    return batches / span, waited, cpu / batches, own


def agents_cpu() -> float:
    """CPU seconds the cluster's agents have used so far (they live from cell to cell): what the relay
    costs them, whatever else runs on the machine."""
    import psutil

    total = 0.0
    for process in psutil.process_iter(["cmdline"]):
        if "NodeAgent" in " ".join(process.info["cmdline"] or []):
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
    return total


def delivery(kernel: harness.Kernel, repeats: int, samples: dict[str, list[float]], progress: Any) -> None:
    kernel.run(DATASETS)
    consume = CONSUME.replace("PASSES", "2")
    slow = consume.replace("LOADER", "slow").replace("STEP", "0.002")
    plain = PLAIN + consume.replace("STEP", "0.002")
    instant = CONSUME.replace("PASSES", "8").replace("LOADER", "instant").replace("STEP", "0")
    local = "#pragma taas --gpus 4 --device cpu --return none --on local\n"
    contenders = (
        ("taas delivery", CELL.replace("--return none", "--return none --cpus 1"), slow, 4),
        ("plain loader", CELL.replace("--return none", "--return none --cpus 0"), plain, 4),
        ("relay, 2 nodes", CELL, instant, 4),
        ("one machine, 4", local, instant, 4),
        ("relay, 1 node", CELL.replace("--gpus 4", "--gpus 2"), instant, 2),
        ("one machine, 2", local.replace("--gpus 4", "--gpus 2"), instant, 2),
    )
    for round_number in range(repeats):  # interleaved: the machine's load changes over minutes
        for key, header, body, ranks in contenders:
            rate, waited, cpu, own = delivered(kernel, header, body, ranks)
            samples[f"{key} batches/s"].append(rate)
            samples[f"{key} wait"].append(waited)
            samples[f"{key} CPU ms/batch"].append(cpu * 1e3)
            for who, seconds in own.items():
                samples[f"{key} {who} ms/batch"].append(seconds * 1e3)
        progress(
            f"delivery round {round_number + 1}: "
            + ", ".join(f"{key} {samples[f'{key} batches/s'][-1]:.0f}" for key, *_ in contenders)
        )


def main(argv: list[str] | None = None) -> int:
    only = argparse.ArgumentParser(add_help=False)
    only.add_argument("--delivery", action="store_true")
    known, rest = only.parse_known_args(argv)
    args = harness.arguments(
        __doc__,
        "fewer repetitions",
        harness.ROOT / "benchmarks/results/cluster.json",
        harness.ROOT / "docs/images/cluster.png",
        rest,
    )
    progress = harness.Progress()
    repeats = {
        "cold": 2 if args.quick else 3,
        "warm": 5 if args.quick else 9,
        "trainer": 2 if args.quick else 3,
        "bandwidth": 2 if args.quick else 3,
        "delivery": 3 if args.quick else 5,
    }
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-cluster-"))
    (folder / "configurations.yaml").write_text(CONFIG)
    (folder / "notebook").mkdir()
    os.environ.update({"TAAS_CONFIG": str(folder / "configurations.yaml"), "GLOO_SOCKET_IFNAME": "lo"})
    import ray

    from taas_magic.local_cluster import LocalCluster

    samples: dict[str, list[float]] = collections.defaultdict(list)
    progress("starting a 3-node Ray cluster on loopback addresses")
    cluster = LocalCluster({"c1.4": 1, "t.2": 2}, cpus_per_node=2)
    kernel = None
    try:
        os.environ["TAAS_CLUSTER"] = cluster.address
        os.environ.update(cluster.variables)  # its token: the notebook's kernel connects with it
        kernel = harness.Kernel()
        # A notebook's folder travels to the nodes with each run: the benchmark's is an empty one
        kernel.run(f"import os\nos.chdir({str(folder / 'notebook')!r})")
        kernel.run("%load_ext taas_magic")
        kernel.check_module("taas_magic")
        if not known.delivery:
            taas_runs(kernel, repeats, samples, progress)
        delivery(kernel, repeats["delivery"], samples, progress)
        if not known.delivery:
            kernel.run("%taas cluster release")  # the agents hold no resources, but they would compete for the cores
            with QuietStdout():
                ray.init(
                    address=cluster.address,
                    _node_ip_address=cluster.addresses[0],
                    log_to_driver=False,
                    logging_level="ERROR",
                )
            try:
                import ray.train  # noqa: F401  (the bench extras: ray[train])
            except ImportError as e:
                progress(f"TorchTrainer skipped: {e}")
            else:
                trainer_runs(str(folder / "train"), repeats, samples, progress)
    finally:
        if kernel is not None:
            kernel.shutdown()
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    info = harness.machine_info("ray")
    if known.delivery:  # the launch figures stay those of the last full run, named as such
        samples, info = with_launch_figures(args.results, dict(samples), info)
    report(dict(samples), args, info)
    return 0


def taas_runs(kernel: harness.Kernel, repeats: dict[str, int], samples: dict[str, list[float]], progress: Any) -> None:
    for attempt in range(repeats["cold"]):
        kernel.run("%taas cluster release")
        seconds, _ = taas_cell(kernel, JOB)
        samples["taas cold"].append(seconds)
        progress(f"taas cold {attempt + 1}: {seconds:.2f} s")
    for attempt in range(repeats["warm"]):
        seconds, _ = taas_cell(kernel, JOB)
        samples["taas warm"].append(seconds)
    progress(f"taas warm: median {statistics.median(samples['taas warm']):.2f} s")
    for _ in range(repeats["bandwidth"]):
        samples["taas GB/s"].append(taas_cell(kernel, BANDWIDTH)[1])
    progress(f"taas all_reduce: median {statistics.median(samples['taas GB/s']):.3f} GB/s")


def trainer_runs(storage: str, repeats: dict[str, int], samples: dict[str, list[float]], progress: Any) -> None:
    for attempt in range(repeats["trainer"]):
        seconds, _ = torch_trainer(JOB, storage)
        samples["TorchTrainer"].append(seconds)
        progress(f"TorchTrainer {attempt + 1}: {seconds:.1f} s")
    for _ in range(repeats["bandwidth"]):
        samples["TorchTrainer GB/s"].append(torch_trainer(BANDWIDTH, storage)[1])
    progress(f"TorchTrainer all_reduce: median {statistics.median(samples['TorchTrainer GB/s']):.3f} GB/s")


class QuietStdout:
    """Ray's driver prints its banner and warnings; the report is stdout alone."""

    def __enter__(self) -> None:
        self.saved = os.dup(1)
        os.dup2(2, 1)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self.saved, 1)
        os.close(self.saved)


def with_launch_figures(results: Path, samples: dict[str, list[float]], info: dict) -> tuple[dict, dict]:
    """This run's delivery figures with the launch figures (cold, warm, bandwidth, TorchTrainer) of
    the run that last wrote ``results``, whose machine record goes along as ``launch machine``."""
    if not results.exists():
        return samples, info
    old = json.loads(results.read_text())
    launch = {
        key: values
        for key, values in old["samples"].items()
        if key.startswith(("taas cold", "taas warm", "taas GB/s", "TorchTrainer"))
    }
    return {**launch, **samples}, {**info, "launch machine": old["machine"].get("launch machine", old["machine"])}


def report(samples: dict[str, list[float]], args: Any, info: dict) -> None:
    median = {key: statistics.median(values) for key, values in samples.items() if values}
    print("Cluster runs, 2 nodes x 2 ranks on CPU (gloo), a local Ray cluster on loopback addresses")
    print(f"{'contender':<32}{'median':>10}  samples")
    for key, values in samples.items():
        unit = "GB/s" if "GB/s" in key else "" if key.endswith(("batches/s", "wait", "ms/batch")) else "s"
        print(f"{key:<32}{median[key]:>8.3f} {unit:<4}  " + ", ".join(f"{v:.3f}" for v in values))
    ratios, checks = launch_checks(median)
    more_ratios, more_checks = delivery_checks(median)
    ratios.update(more_ratios)
    harness.print_checks(checks + more_checks)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(
        json.dumps(
            {"machine": info, "samples": samples, "medians": median, "ratios": ratios, "command": " ".join(sys.argv)},
            indent=2,
        )
        + "\n"
    )
    plot(args.plot, samples, median)
    print(f"figures: {harness.shown(args.results)}, plot: {harness.shown(args.plot)}")


def launch_checks(median: dict[str, float]) -> tuple[dict[str, float], list[tuple[bool, str]]]:
    if "TorchTrainer" not in median:
        return {}, []
    ratios = {
        "warm": median["taas warm"] / median["TorchTrainer"],
        "cold": median["taas cold"] / median["TorchTrainer"],
        "bandwidth": median["taas GB/s"] / median["TorchTrainer GB/s"] if median.get("TorchTrainer GB/s") else 0.0,
    }
    return ratios, [
        (
            ratios["warm"] <= TARGETS["warm"],
            f"warm taas cell / TorchTrainer fit = {ratios['warm']:.3f}x (target <= {TARGETS['warm']}x)",
        ),
        (
            ratios["cold"] <= TARGETS["cold"],
            f"cold taas cell / TorchTrainer fit = {ratios['cold']:.3f}x (target <= {TARGETS['cold']}x)",
        ),
        (
            ratios["bandwidth"] >= TARGETS["bandwidth"],
            f"all_reduce bandwidth, taas / TorchTrainer = "
            f"{ratios['bandwidth']:.2f}x (target >= {TARGETS['bandwidth']}x)",
        ),
    ]


def delivery_checks(median: dict[str, float]) -> tuple[dict[str, float], list[tuple[bool, str]]]:
    rate = {key: median[f"{key} batches/s"] for key in DELIVERY_KEYS + RELAY_KEYS}
    ratios = {
        "delivery": rate["taas delivery"] / rate["plain loader"],
        "relay": rate["relay, 2 nodes"] / rate["one machine, 4"],
        "relay, 1 node": rate["relay, 1 node"] / rate["one machine, 2"],
        "node GB/s": rate["relay, 1 node"] * BATCH_BYTES / 1e9,
        "node GB/s, 2 nodes": rate["relay, 2 nodes"] * BATCH_BYTES / 2 / 1e9,
    }
    print(
        f"delivery from the c1.4 node / a DataLoader in each rank = {ratios['delivery']:.2f}x the batches/s; "
        f"ranks waited {median['taas delivery wait']:.0%} against {median['plain loader wait']:.0%}"
    )
    for key in RELAY_KEYS:
        print(
            f"{key:<16} {rate[key]:6.0f} batches/s = {rate[key] * BATCH_BYTES / 1e9:.2f} GB/s; CPU per batch: "
            f"{median[f'{key} CPU ms/batch']:.1f} ms (the whole machine), "
            f"agents {median[f'{key} agents ms/batch']:.2f} ms, "
            f"ranks {median[f'{key} ranks ms/batch']:.2f} ms"
        )
    print(
        f"into each node's ranks with 2 nodes: {ratios['node GB/s, 2 nodes']:.2f} GB/s; "
        f"relay, 1 node / one machine, 2 ranks = {ratios['relay, 1 node']:.2f}x"
    )
    return ratios, [
        (
            ratios["relay"] >= TARGETS["relay"],
            f"relayed across nodes / one machine, 4 ranks = {ratios['relay']:.2f}x "
            f"the batches/s (target >= {TARGETS['relay']}x)",
        ),
        (
            ratios["node GB/s"] >= TARGETS["node GB/s"],
            f"batches into one node's ranks = {ratios['node GB/s']:.2f} GB/s (target >= {TARGETS['node GB/s']} GB/s)",
        ),
    ]


def plot(path: Path, samples: dict[str, list[float]], median: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (start, bandwidth, data) = plt.subplots(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [3, 2, 4]})
    keys = ["taas warm", "taas cold", "TorchTrainer"]
    if not all(samples.get(key) for key in keys + ["taas GB/s", "TorchTrainer GB/s"]):
        start.set_axis_off()
        bandwidth.set_axis_off()
        keys = []
    if keys:
        launch_panels(start, bandwidth, samples, median)
    data_panel(data, samples, median)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def launch_panels(start: Any, bandwidth: Any, samples: dict[str, list[float]], median: dict[str, float]) -> None:
    keys = ["taas warm", "taas cold", "TorchTrainer"]
    start.barh(keys, [median[key] for key in keys], color=["#2a7", "#7c5", "#888"])
    for row, key in enumerate(keys):
        start.plot(samples[key], [row] * len(samples[key]), "k.", markersize=4)
        start.text(max(samples[key]) * 1.08, row, f"{median[key]:.2f} s", va="center")
    start.set_xscale("log")
    start.set_xlim(right=max(max(samples[key]) for key in keys) * 2.2)
    start.set_xlabel("seconds to run a 2-node x 2-rank gloo job (log scale; dots: each run)")
    start.set_title("Start to end of a trivial job")
    keys = ["taas GB/s", "TorchTrainer GB/s"]
    bandwidth.bar(["taas", "TorchTrainer"], [median[key] for key in keys], color=["#2a7", "#888"])
    bandwidth.set_ylabel("GB/s (16 MB all_reduce)")
    bandwidth.set_title("all_reduce bandwidth")


def data_panel(data: Any, samples: dict[str, list[float]], median: dict[str, float]) -> None:
    keys = [f"{key} batches/s" for key in RELAY_KEYS]
    names = ["4 ranks,\nrelayed", "4 ranks,\none machine", "2 ranks,\nrelayed", "2 ranks,\none machine"]
    data.bar(names, [median[key] * BATCH_BYTES / 1e9 for key in keys], color=["#2a7", "#bbb", "#2a7", "#bbb"])
    for column, key in enumerate(keys):
        data.plot([column] * len(samples[key]), [v * BATCH_BYTES / 1e9 for v in samples[key]], "k.", markersize=4)
        data.text(
            column, max(samples[key]) * BATCH_BYTES / 1e9 + 0.02, f"{median[key]:.0f}/s", ha="center", va="bottom"
        )
    data.axhline(TARGETS["node GB/s"], color="#c33", linewidth=0.8, linestyle="--")
    data.set_ylabel("GB/s of 3.2 MB batches into the ranks")
    data.set_ylim(top=max(max(samples[key]) for key in keys) * BATCH_BYTES / 1e9 * 1.15)
    data.set_title("A registered loader, from the c1.4 node or on one machine")


if __name__ == "__main__":
    sys.exit(main())
