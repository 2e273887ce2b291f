"""A session on a Ray cluster through a rank's death and a resize, beside what a user does without them: start it again.

A Ray cluster of three ``t.2`` nodes on loopback addresses (``LocalCluster``), a session of 4 CPU ranks, 2 on each
of two nodes, training the DDP model of ``session_faults.py`` (three 1024x1024 layers with Adam: about 37 MB of
state per rank). Each round: one rank is killed with SIGKILL in the middle of training, and a new process takes its
place on its node, given the others' common state over the process group (timed from the death to the end of the
cell); ``%taas resize 2`` ends node 1's ranks (the node stays held for the session) and ``%taas resize 4`` starts
new ones there (each timed to the end of its line); ``%taas resize 6`` grows the session onto the third node, which
it did not start with (held for it in a placement group of its own; its agent is cold in the first round only); and
the alternative, ``%taas stop`` and the cell that starts the session again on the cluster (its nodes placed, its
agents' fork servers warm), in the same kernel, in every round. Then a session that trains on a registered loader its
producers serve (on the session's node 0: the cluster has no CPU node) has a rank killed mid-pass each round: the new
process also takes over the dead rank's share of the stream, after its node copied in every node's counters.

Run: ``python benchmarks/cluster_session_faults.py`` (``--quick``: 2 rounds instead of 5).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import tempfile
from pathlib import Path

from harness import ROOT, Kernel, Progress, arguments, machine_info, print_checks, shown
from session_faults import FAULT_SERVED, HEAL_TARGET_S, RANKS, SERVED, START, fault, resize, restart

CONFIG = "configurations:\n  t.2: {cpus: 2, gpus: 2, memory_gb: 4}\n"
ON_THE_CLUSTER = START.replace(
    f"#pragma taas --gpus {RANKS} --keep --start fork", f"#!t.2\n#pragma taas --gpus {RANKS} --keep --device cpu"
)


def main(argv: list[str] | None = None) -> None:
    args = arguments(
        __doc__ or "",
        "2 rounds instead of 5",
        ROOT / "benchmarks/results/cluster_session_faults.json",
        ROOT / "docs/images/cluster_session_faults.png",  # no plot: the table says it
        argv,
    )
    rounds = 2 if args.quick else 5
    progress, rng = Progress(), random.Random(7)
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-cluster-sessions-"))
    (folder / "configurations.yaml").write_text(CONFIG)
    (folder / "notebook").mkdir()
    os.environ.update({"TAAS_CONFIG": str(folder / "configurations.yaml"), "GLOO_SOCKET_IFNAME": "lo"})
    from taas_magic.local_cluster import LocalCluster

    progress("starting a 3-node Ray cluster on loopback addresses")
    cluster = LocalCluster({"t.2": 3}, cpus_per_node=2)
    kernel = None
    figures: dict[str, list[float]] = {
        "healed_s": [],
        "resized_down_s": [],
        "resized_up_s": [],
        "grown_onto_a_new_node_s": [],
        "restarted_s": [],
        "healed_serving_a_loader_s": [],
    }
    try:
        os.environ["TAAS_CLUSTER"] = cluster.address
        os.environ.update(cluster.variables)
        kernel = Kernel()
        kernel.run(f"import os\nos.chdir({str(folder / 'notebook')!r})")  # the folder that travels: an empty one
        kernel.run("%load_ext taas_magic")
        kernel.run(ON_THE_CLUSTER, timeout=300)
        for round_ in range(rounds):
            progress(f"round {round_ + 1} of {rounds}")
            figures["healed_s"].append(fault(kernel, "os.kill(os.getpid(), signal.SIGKILL)", rng)[0])
            figures["resized_down_s"].append(resize(kernel, RANKS // 2, []))
            figures["resized_up_s"].append(resize(kernel, RANKS, []))
            figures["grown_onto_a_new_node_s"].append(resize(kernel, RANKS + RANKS // 2, []))
            figures["restarted_s"].append(restart(kernel, ON_THE_CLUSTER))
        kernel.run("%taas stop")
        kernel.run(SERVED)
        kernel.run(ON_THE_CLUSTER, timeout=300)
        for round_ in range(rounds):
            progress(f"round {round_ + 1} of {rounds}, training on a served loader")
            figures["healed_serving_a_loader_s"].append(
                fault(kernel, "os.kill(os.getpid(), signal.SIGKILL)", rng, FAULT_SERVED)[0]
            )
        kernel.run("%taas stop")
    finally:
        if kernel is not None:
            left = kernel.shutdown()
            if left:
                print(f"left behind and killed: {left}")
        cluster.shutdown()
    report(figures, args.results, rounds)


def report(figures: dict[str, list[float]], results: Path, rounds: int) -> None:
    rows = {
        "healed_s": "a rank killed: death -> healed on its node",
        "resized_down_s": f"%taas resize {RANKS // 2} (node 1's ranks end)",
        "resized_up_s": f"%taas resize {RANKS} (new ranks on node 1)",
        "grown_onto_a_new_node_s": f"%taas resize {RANKS + RANKS // 2} (onto a node it did not hold)",
        "restarted_s": "%taas stop + the session started again",
        "healed_serving_a_loader_s": "a rank killed, training on a served loader",
    }
    median = {key: statistics.median(values) for key, values in figures.items()}
    print(
        f"a {RANKS}-rank CPU session on 2 of 3 nodes of a local Ray cluster, DDP and Adam (37 MB per rank), "
        f"{rounds} rounds"
    )
    print(f"{'':46} {'median':>8} {'max':>8}")
    for key, label in rows.items():
        print(f"{label:46} {median[key]:7.2f} s {max(figures[key]):6.2f} s")
    print(f"starting again / healing: {median['restarted_s'] / median['healed_s']:.1f}x")
    print(f"starting again / growing back: {median['restarted_s'] / median['resized_up_s']:.1f}x")
    heal, served = median["healed_s"], median["healed_serving_a_loader_s"]
    print_checks(
        [
            (heal <= HEAL_TARGET_S, f"healed {heal:.2f} s after the death (target <= {HEAL_TARGET_S:g} s)"),
            (served <= HEAL_TARGET_S, f"healed {served:.2f} s, serving a loader (target <= {HEAL_TARGET_S:g} s)"),
        ]
    )
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(
        json.dumps({"machine": machine_info("ray"), "ranks": RANKS, "rounds": rounds, **figures}, indent=1) + "\n"
    )
    print(f"results: {shown(results)}")


if __name__ == "__main__":
    main()
