"""Cluster runs on a real Ray cluster on this machine: a CPU head node (c1.4) and t.2 nodes, each
raylet on its own loopback address, logical GPUs, ranks on CPU over gloo.

The kernel connects through TAAS_CLUSTER as a user's would. Every test checks what a user
sees, and that a run leaves nothing behind on any node: no placement group, no run folder, no
process of the run.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import pathlib
import re
import tempfile
import time

import pytest
from support.cells import GATHERED_STATE, drawn_passes, replicas_equal
from support.cluster import (
    COLLECT,
    DATA,
    HEADER,
    INIT,
    collected,
    header,
    leftovers,
    network,
    node_agents,
    own_ray,
    placement_groups,
    rank_processes,
)
from support.kernel import ANSI, Kernel, view_notes
from support.notebook_values import KINDS, SETUP, unpicklable

ray = pytest.importorskip("ray")


def test_two_nodes_reduce_together_with_torchrun_variables_and_results_come_back(cluster, cluster_kernel):
    local, _ = cluster
    r = cluster_kernel.execute(
        HEADER
        + INIT
        + """\
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
names = ('RANK', 'LOCAL_RANK', 'GROUP_RANK', 'LOCAL_WORLD_SIZE', 'WORLD_SIZE', 'GROUP_WORLD_SIZE', 'MASTER_ADDR')
print('env', ' '.join(os.environ[n] for n in names), 'sum', int(x.item()))
total = int(x.item())
torch.save({'rank': dist.get_rank()}, 'weights.pt')
dist.destroy_process_group()
""",
        timeout=240,
    ).ok()
    rows = sorted(line.split("env ")[1] for line in r.stdout.splitlines() if "env " in line)
    assert len(rows) == 4, r.stdout
    master = rows[0].split()[6]
    assert master in local.addresses[1:] and master != "127.0.0.1"
    assert rows == [f"{rank} {rank % 2} {rank // 2} 2 4 2 {master} sum 10" for rank in range(4)]
    assert "copied into this notebook's folder" in r.stderr and "weights.pt" in r.stderr
    assert cluster_kernel.value("total") == 10
    assert cluster_kernel.value("torch.load('weights.pt')") == {"rank": 0}
    assert not leftovers(cluster_kernel)


def test_no_agent_imports_torch_not_even_node_0s_which_has_the_runs_store(cluster_kernel):
    """Torch is the fork server's, on each node: in an agent (a Ray worker) it would cost 2 s of CPU and about
    500 MB more. Node 0's supervisor serves the run's store, which node 0's agent once served itself."""
    cluster_kernel.execute(HEADER + INIT + "dist.barrier()\ndist.destroy_process_group()", timeout=240).ok()
    agents = node_agents()
    assert len(agents) == 2, agents
    with_torch = [agent.pid for agent in agents if any("libtorch" in m.path for m in agent.memory_maps())]
    assert not with_torch, f"agents that imported torch: {with_torch}"


def test_registered_loaders_are_fed_from_a_cpu_node_exactly_once_in_the_same_order_as_here(cluster, registered):
    local, _ = cluster
    cluster_kernel = registered
    r = cluster_kernel.execute(HEADER + COLLECT, timeout=240).ok()
    got = collected(r)
    here = collected(
        cluster_kernel.execute("#pragma taas --gpus 4 --device cpu --on local\n" + COLLECT, timeout=120).ok()
    )
    assert sorted(got) == [0, 1, 2, 3], r.stdout
    for number in range(2):
        per_rank = [[i for batch in got[rank]["passes"][number] for i in batch] for rank in range(4)]
        assert [len(got[rank]["passes"][number]) for rank in range(4)] == [4] * 4 == [got[0]["len"]] * 4
        union = [i for part in per_rank for i in part]
        assert sorted(set(union)) == list(range(50)), "every element of the pass is delivered"
        assert len(union) == 62 and len(union) - len(set(union)) == 12, "13 batches padded to 16"
    assert {rank: g["passes"] for rank, g in got.items()} == {rank: g["passes"] for rank, g in here.items()}, (
        "the same order as on this machine"
    )
    head = int(local.addresses[0].split(".")[-1])
    assert {node for g in got.values() for node in g["built"]} == {head}, "built on the CPU node alone"
    assert re.search(r"taas: loader: \d+ elements delivered to 4 ranks", r.stderr), r.stderr
    views = [d["text/plain"] for d in r.displays]
    assert views and views[-1].startswith("taas: 4 ranks on cpu · done in "), views
    assert any(line.startswith("loader ") and " produced · " in line for line in views[-1].splitlines()), views
    assert any(line.startswith("node 1 ") and "2 done" in line for line in views[-1].splitlines()), views
    assert not leftovers(cluster_kernel)


def test_a_loader_with_its_own_generator_is_fed_from_the_cpu_node_in_the_order_it_draws(registered):
    """The seeded loader users write for runs they can repeat (the cluster example's): a dataset of tensors,
    then the generator, whose state lies behind them in the memory file the nodes' supervisors and
    producers unpickle (which crashed them: ``test_shipping.py`` says how)."""
    cluster_kernel = registered
    cluster_kernel.execute(
        "from torch.utils.data import TensorDataset\n"
        "seeded = DataLoader(TensorDataset(torch.arange(32)), batch_size=4, shuffle=True,\n"
        "                    generator=torch.Generator().manual_seed(3))\n"
        "taas.register(seeded)"
    ).ok()
    cell = "print('GOT ' + json.dumps({'rank': taas.rank(), 'passes': [[b[0].tolist() for b in seeded]]}))\n"
    try:
        r = cluster_kernel.execute(HEADER + cell, timeout=240).ok()
        got = collected(r)
        here = collected(cluster_kernel.execute("#pragma taas --gpus 4 --device cpu --on local\n" + cell).ok())
        drawn = cluster_kernel.execute(
            "print(torch.randperm(32, generator=torch.Generator().manual_seed(3)).tolist())"
        ).ok()
        order = json.loads(drawn.stdout)
        assert got == here, r.stdout
        assert [got[rank]["passes"][0] for rank in range(4)] == [
            [order[4 * batch : 4 * batch + 4] for batch in range(rank, 8, 4)] for rank in range(4)
        ], "batch b of the loader's own first pass goes to rank b mod 4"
    finally:
        cluster_kernel.execute("taas.unregister(seeded)").ok()
    assert not leftovers(cluster_kernel)


def test_without_cpu_nodes_producers_take_turns_on_the_run_s_nodes_and_units_hold(cluster, registered):
    """Producers on the nodes of the ranks when the cluster has no node for them: here, by naming a
    configuration for producer nodes that the cluster lacks (c1.80)."""
    cluster_kernel = registered
    local, _ = cluster
    cluster_kernel.execute("import taas_magic.kernel.cluster_link as _link\n_link.PRODUCER_NODE = 'c1.80'").ok()
    try:
        r = cluster_kernel.execute(
            "#!t.2\n#pragma taas --gpus 4 --device cpu --cpus 2 --units 20\n" + COLLECT, timeout=240
        ).ok()
        built = cluster_kernel.execute(
            "#!t.2\n#pragma taas --gpus 4 --device cpu --cpus 2\n"
            "print('BUILT', sorted({int(b[0, 1]) for b in loader}))",
            timeout=240,
        ).ok()
    finally:
        cluster_kernel.execute("_link.PRODUCER_NODE = 'c1.4'").ok()
    got = collected(r)
    assert [[len(p) for p in got[rank]["passes"]] for rank in range(4)] == [[4, 2]] * 4, "13 units, then 7 of 20"
    assert all(g["built"] == [] for g in got.values()), "the third pass is beyond --units"
    here = collected(
        cluster_kernel.execute("#pragma taas --gpus 4 --device cpu --on local --units 20\n" + COLLECT, timeout=120).ok()
    )
    assert {rank: g["passes"] for rank, g in got.items()} == {rank: g["passes"] for rank, g in here.items()}
    r = built
    nodes = {node for line in r.stdout.splitlines() if "BUILT" in line for node in json.loads(line.split("BUILT ")[1])}
    assert nodes == {int(address.split(".")[-1]) for address in local.addresses[1:]}, (
        "one producer on each node of the run, none on the CPU node"
    )
    assert not leftovers(cluster_kernel)


def test_more_producers_than_cpu_nodes_is_refused_in_one_line(registered):
    cluster_kernel = registered
    r = cluster_kernel.execute(header("--cpus 2") + "print('never', len(loader))", timeout=30)
    assert r.error is not None and r.error["ename"] == "TaasUsageError"
    assert (
        "2 data producers need a node of c1.4 each, the cluster has 1: ask for fewer with --cpus" in r.error["evalue"]
    )
    assert "never" not in r.stdout and not leftovers(cluster_kernel)


def test_a_failing_dataset_on_the_cpu_node_fails_the_cell_naming_the_loader_and_element(registered):
    cluster_kernel = registered
    cluster_kernel.execute("broken = DataLoader(Indices(40, fail_at=21), batch_size=4)\ntaas.register(broken)").ok()
    try:
        r = cluster_kernel.execute(HEADER + "for batch in broken:\n    pass", timeout=120)
    finally:  # a loader left registered would fail the module's later tests, not this one
        cluster_kernel.execute("taas.unregister(broken)").ok()
    assert r.error is not None, r.stdout
    assert r.error["evalue"].startswith(
        "producer 0 of broken failed at element 5 of pass 0 (samples [20, 21, 22, 23]): "
    )
    assert "ValueError: sample 21 is corrupt" in r.error["evalue"] and "raise ValueError" in r.traceback
    assert re.search(r"Cell In\[\d+\]", r.traceback), (
        "the dataset's cell, shipped for tracebacks, is named as IPython names it"
    )
    assert r.seconds < 20
    assert not leftovers(cluster_kernel)


def test_an_interrupt_stops_ranks_and_producers_on_every_node(registered):
    cluster_kernel = registered
    cluster_kernel.execute("""
import time
class Slow(Indices):
    def __getitem__(self, i):
        time.sleep(0.5)
        return super().__getitem__(i)
slow = DataLoader(Slow(1000), batch_size=2)
taas.register(slow)
""").ok()
    try:
        r = cluster_kernel.execute(HEADER + "for batch in slow:\n    pass", timeout=60, interrupt_after=5)
    finally:
        cluster_kernel.execute("taas.unregister(slow)").ok()
    assert r.error is not None and "KeyboardInterrupt" in r.traceback, r.error
    assert r.seconds < 5 + 10
    assert not leftovers(cluster_kernel)


def test_the_store_port_is_open_for_the_run_only(cluster_kernel):
    # The barrier first: a rank that leaves while gloo still connects the others' mesh breaks their setup.
    r = cluster_kernel.execute(
        HEADER + INIT + "print('store', os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])\n"
        "dist.barrier()\ndist.destroy_process_group()",
        timeout=120,
    ).ok()
    address, port = r.stdout.split("store ")[1].split()[:2]
    import socket

    with socket.socket() as probe:
        assert probe.connect_ex((address, int(port))) != 0, "node 0 closed the run's store with the run"


def test_a_node_with_other_versions_is_refused_before_anything_starts(cluster, cluster_kernel):
    """The kernel compares its own versions with each new agent's (here the kernel claims others)."""
    cluster_kernel.execute("%taas cluster release").ok()
    cluster_kernel.execute(
        "import taas_magic.launch.cluster.agent as _agent\n_versions = _agent.versions\n"
        "_agent.versions = lambda: ('3.99.0', '9.9', '9.9.9')"
    ).ok()
    try:
        r = cluster_kernel.execute(HEADER + "print('never')", timeout=240)
    finally:
        cluster_kernel.execute("_agent.versions = _versions").ok()
    assert r.error is not None and r.error["ename"] == "TaasUsageError", r.error
    assert re.search(
        rf"node {re.escape(network(cluster[0].addresses))}\d+ runs Python 3\.\d+\.\d+, torch \S+, taas-magic \S+; "
        r"this kernel runs "
        r"Python 3\.99\.0, torch 9\.9, taas-magic 9\.9\.9: install the same on every node",
        r.error["evalue"],
    )
    assert "never" not in r.stdout and not leftovers(cluster_kernel)
    cluster_kernel.execute(HEADER + "print('matching again')", timeout=240).ok()


def test_a_warm_cell_starts_in_about_a_second(cluster_kernel):
    cluster_kernel.execute(HEADER + "pass", timeout=240).ok()
    r = cluster_kernel.execute(HEADER + "print('warm', os.environ['RANK'])", timeout=60).ok()
    assert sorted(line for line in r.stdout.splitlines() if "warm" in line) == [
        f"[rank {rank}] warm {rank}" for rank in range(4)
    ]
    assert r.seconds < 5, r.seconds  # about 0.3 s on an idle 2-core machine; shared CI machines are slower


def test_the_local_clusters_ranks_run_at_the_notebooks_priority(cluster_kernel):
    """Ray starts its workers at niceness 15; the local cluster's ranks run as local ranks and torchrun's do,
    or a busy machine starves them (a first cell took 204 s instead of 56 s beside four busy processes)."""
    mine = os.nice(0)
    r = cluster_kernel.execute(HEADER + "print('nice', os.environ['RANK'], os.nice(0))", timeout=60).ok()
    assert sorted(line for line in r.stdout.splitlines() if "nice" in line) == [
        f"[rank {rank}] nice {rank} {mine}" for rank in range(4)
    ], r.stdout


def test_a_cluster_runs_summary_names_the_rank_the_others_waited_for(cluster_kernel):
    r = cluster_kernel.execute(
        HEADER
        + INIT
        + "import time, torch\nfor _ in range(30):\n    if dist.get_rank() == 3:\n        time.sleep(0.2)\n"
        "    dist.all_reduce(torch.ones(1))\n",
        timeout=240,
    ).ok()
    notes = view_notes(r.displays[-1]["text/plain"])
    assert notes and notes[-1].startswith("the others waited for rank 3: "), r.displays[-1]["text/plain"]


# Five seconds: the picture needs four samples of each rank's time, about one a second (rank/vitals.py).
REDUCING = "import time, torch\nfor _ in range(5):\n    dist.all_reduce(torch.ones(1))\n    time.sleep(1)\n"


def merged_rows(trace) -> dict[str, int]:
    """Each rank's row in a merged trace, with the number of its gloo all_reduces."""
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    reduces = [e["pid"] for e in events if e.get("name") == "gloo:all_reduce"]
    return {name: reduces.count(pid) for pid, name in rows.items()}


def test_profile_brings_every_nodes_traces_back_into_one_merged_trace_one_shot_and_in_a_session(cluster_kernel):
    folder = cluster_kernel.value("os.getcwd()")
    before = set(glob.glob(os.path.join(folder, "taas-profile-*.json.gz")))
    profiled = header("--profile")
    r = cluster_kernel.execute(profiled + INIT + REDUCING, timeout=240).ok()
    (trace,) = {pathlib.Path(p) for p in glob.glob(os.path.join(folder, "taas-profile-*.json.gz"))} - before
    rows = merged_rows(trace)
    assert sorted(rows) == [f"rank {rank}" for rank in range(4)], rows  # ranks 2 and 3 ran on the other node
    assert all(count >= 5 for count in rows.values()), rows
    assert f"taas: --profile: the ranks' trace is {trace} (" in r.stderr, r.stderr
    assert [display for display in r.displays if "image/svg+xml" in display], "the picture is shown"
    assert not leftovers(cluster_kernel)
    cluster_kernel.execute(profiled.replace("--profile", "--keep --return none") + INIT).ok()
    try:
        r = cluster_kernel.execute("#pragma taas --profile --ranks 1-2\n" + REDUCING.replace("range(5)", "range(0)"))
        r.ok()
        (second,) = (
            {pathlib.Path(p) for p in glob.glob(os.path.join(folder, "taas-profile-*.json.gz"))} - before - {trace}
        )
        assert sorted(merged_rows(second)) == ["rank 1", "rank 2"], "a session cell's ranks, one on each node"
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "taas-profile-*")), "no trace stays in a temporary folder"


def test_a_failing_rank_fails_the_cell_with_its_traceback_and_the_next_cell_runs(cluster_kernel):
    started = time.monotonic()
    r = cluster_kernel.execute(
        HEADER
        + INIT
        + """\
if dist.get_rank() == 3:
    raise ValueError('bad batch on rank 3')
dist.barrier()
""",
        timeout=120,
    )
    assert r.error is not None and "rank 3 failed" in r.error["evalue"] and "bad batch on rank 3" in r.error["evalue"]
    assert "raise ValueError('bad batch on rank 3')" in r.traceback
    # The peers on both nodes waited in the barrier: stopped by the failure, whoever saw rank 3 leave first.
    assert "stopped after the failure: ranks 0-2" in r.traceback and "also failed" not in r.traceback, r.traceback
    assert "Connection" not in r.traceback + r.stderr and "where they were when rank 3 failed:" in r.traceback
    assert time.monotonic() - started < 30
    cluster_kernel.execute(HEADER + "print('again')", timeout=60).ok()
    assert not leftovers(cluster_kernel)


def test_an_error_in_every_rank_of_every_node_is_told_as_such_every_time(cluster_kernel):
    """Every rank raises at once: a node whose ranks have all exited is told so, and its supervisor leaves,
    as the kernel asks it where its ranks were for another rank's failure. That request met a closed
    channel and the cell said the run was lost, in up to 8 runs of 10; 20 in a row now say the error."""
    said = []
    for _ in range(20):
        r = cluster_kernel.execute(HEADER + "undefined_name + 1", timeout=120)
        said.append(r.error["ename"] + ": " + r.error["evalue"] if r.error is not None else "no error")
    assert all(line.startswith("RankFailed: rank ") and "NameError" in line for line in said), said
    assert not leftovers(cluster_kernel)


def test_breakpoint_and_taas_debug_on_a_node_show_the_cells_lines_around_where_the_rank_stopped(cluster_kernel):
    r = cluster_kernel.execute(
        HEADER + "import os\nmine = int(os.environ['RANK'])\nx = 5\nif mine == 3:\n    breakpoint()\n    x = 6\ny = x",
        answers=["c"],
        timeout=120,
    ).ok()
    shown = ANSI.sub("", r.each_rank())
    for line in ("    breakpoint()", "    x = 6", "y = x"):
        assert re.search(rf"^\[rank 3\] .*\d+ {re.escape(line)}$", shown, re.M), shown
    first = cluster_kernel.execute(header("--keep") + "import os\nmine = int(os.environ['RANK'])", timeout=240).ok()
    try:
        r = cluster_kernel.execute(
            "#pragma taas --ranks 3\nfactor = 7\nraise KeyError(f'on rank {mine}')\ndone = 1", timeout=60
        )
        assert r.error["evalue"] == "rank 3 failed: KeyError: 'on rank 3'", first.stdout
        shown = ANSI.sub("", cluster_kernel.execute("%taas debug", answers=["c"], timeout=60).ok().each_rank())
        for line in ("factor = 7", "raise KeyError(f'on rank {mine}')", "done = 1"):
            assert re.search(rf"^\[rank 3\] .*\d+ {re.escape(line)}$", shown, re.M), shown
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)


def test_a_failed_run_starts_again_on_the_cluster_with_max_restarts(cluster_kernel):
    r = cluster_kernel.execute(
        header("--max-restarts 1")
        + INIT
        + """\
restart = int(os.environ['TORCHELASTIC_RESTART_COUNT'])
if restart == 0 and dist.get_rank() == 3:
    raise RuntimeError('node 1 had a bad start')
dist.barrier()
started_again = restart
dist.destroy_process_group()
""",
        timeout=120,
    ).ok()
    assert "rank 3 failed: RuntimeError: node 1 had a bad start: every rank starts again (restart 1 of" in r.stderr
    assert cluster_kernel.value("started_again") == 1
    assert not leftovers(cluster_kernel)


def test_a_session_spans_the_nodes_and_keeps_its_ranks_from_cell_to_cell(cluster_kernel):
    first = cluster_kernel.execute(
        header("--keep") + INIT + "mine = dist.get_rank()\nprint('pid ' + str(os.getpid()), flush=True)",
        timeout=240,
    ).ok()
    try:
        cluster_kernel.execute("offset = torch.tensor([100.0])").ok()
        r = cluster_kernel.execute(
            "#pragma taas\nprint('pid ' + str(os.getpid()), flush=True)\n"
            "x = torch.ones(1) * mine + offset\ndist.all_reduce(x)\ntotal = x.item()",
            timeout=60,
        ).ok()
        assert sorted(re.findall(r"pid \d+", r.stdout)) == sorted(re.findall(r"pid \d+", first.stdout)), (
            "the same processes on every node run the next cell"
        )
        assert cluster_kernel.value("total") == 406.0, "the notebook's new tensor reached every node"
        cluster_kernel.execute("%taas pull mine").ok()
        assert cluster_kernel.value("(list(mine), mine.ranks)") == ([0, 1, 2, 3], (0, 1, 2, 3)), "from both nodes"
        cluster_kernel.execute("offset = 'pushed'\n%taas push offset --ranks 2-3").ok()
        r = cluster_kernel.execute("#pragma taas --from all\nseen = str(offset)", timeout=60).ok()
        assert cluster_kernel.value("list(seen)") == ["tensor([100.])"] * 2 + ["pushed"] * 2
        cluster_kernel.execute(
            "#pragma taas\nmodel = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.01)",
            timeout=60,
        ).ok()
        r = cluster_kernel.execute(
            "#pragma taas\nprint('training', flush=True)\nwhile True:\n"
            "    model(torch.randn(4, 8)).square().sum().backward()\n    opt.step()\n    opt.zero_grad()",
            interrupt_after=1.0,
            counted_from="training",
            timeout=60,
        )
        assert re.search(r"ranks 0-3 stopped after optimizer step \d+ of this cell, each with the same", r.traceback), (
            r.traceback
        )
        cluster_kernel.execute(
            "#pragma taas --from all\nsums = float(sum(p.detach().double().sum() for p in model.parameters()))",
            timeout=60,
        ).ok()
        assert len(set(cluster_kernel.value("list(sums)"))) == 1, "the replicas on both nodes stopped at one step"
        r = cluster_kernel.execute("#pragma taas --ranks 3\nraise KeyError(f'on rank {mine}')", timeout=60)
        assert r.error["evalue"] == "rank 3 failed: KeyError: 'on rank 3'" and "the session goes on" in r.traceback
        r = cluster_kernel.execute("%taas debug", answers=["p mine", "q"], timeout=60).ok()
        assert "[rank 3] 3" in r.each_rank(), r.stdout
        assert "session:             up: 4 ranks" in cluster_kernel.execute("%taas").ok().stdout
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)


WHERE = "#pragma taas\nprint('at', dist.get_rank(), os.getpid(), os.environ['TAAS_NODE_ADDRESS'], flush=True)\n"
DYING_RANK_3 = """#pragma taas
import signal
print("training", flush=True)
for step in range(1_000_000):
    if dist.get_rank() == 3 and step == 20:
        os.kill(os.getpid(), signal.SIGKILL)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
"""
TRAINING = (
    "#pragma taas\nprint('training', flush=True)\nwhile True:\n"
    "    model(torch.randn(4, 8)).square().sum().backward()\n    opt.step()\n    opt.zero_grad()"
)
# --cpus 0: loaders the module's other tests registered in this kernel are not served (a session on the cluster
# serves every loader registered before it starts, and one that does is not resized)
DDP_SESSION = (
    header("--keep --cpus 0") + INIT + "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
)
SUMS = "#pragma taas --from all\nsums = float(sum(p.detach().double().sum() for p in model.parameters()))"


def told_between_cells(kernel, death: str) -> None:
    """Until ``%taas`` tells ``death`` and that a new process takes the rank's place: its node's supervisor reaps
    it, and its agent tells the kernel when next asked."""
    told, deadline = f"{death}: a new process takes its place", time.monotonic() + 20
    while told not in (shown := kernel.execute("%taas", timeout=60).ok()).stderr:
        assert time.monotonic() < deadline, shown.stderr
        time.sleep(0.5)


def trains_on_with_equal_replicas(kernel, ranks: str) -> None:
    """The session's replicas are equal (a new rank was given the live peers' model), its DDP training stops
    together when interrupted, and they are equal after."""
    assert equal_replicas(kernel), "a new rank was given the live peers' model"
    cell = kernel.execute(TRAINING, interrupt_after=1.0, counted_from="training", timeout=60)
    assert f"{ranks} stopped after optimizer step" in cell.traceback, cell.traceback
    assert equal_replicas(kernel)


def equal_replicas(kernel) -> bool:
    kernel.execute(SUMS, timeout=60).ok()
    return len(set(kernel.value("list(sums)"))) == 1


def where(result) -> dict[int, tuple[int, str]]:
    """Each rank's process id and node, as ``WHERE`` printed them."""
    return {int(rank): (int(pid), node) for rank, pid, node in re.findall(r"at (\d) (\d+) (\S+)", result.stdout)}


def test_a_rank_killed_in_a_session_is_replaced_on_its_node_and_ddp_trains_on(cluster_kernel):
    """A 2-node session trains a DDP model. Rank 3 (node 1) is killed with SIGKILL mid-training: the cell says so,
    a new process takes its place on the same node, given the model from a live peer, and the same DDP model
    trains on with equal replicas. Then rank 1 (node 0, beside the run's store) is killed between cells: %taas
    says so, and the next cell runs with a new process in its place."""
    cluster_kernel.execute(DDP_SESSION, timeout=240).ok()
    try:
        first = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert len(first) == 4 and first[0][1] != first[3][1], first
        r = cluster_kernel.execute(DYING_RANK_3, timeout=120)
        assert r.error["evalue"] == "rank 3 failed: killed by signal SIGKILL", r.traceback
        assert "the session goes on" in r.traceback and r.seconds < 30, (r.seconds, r.traceback)
        after = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert after[3][0] != first[3][0] and after[3][1] == first[3][1], (first, after)  # a new one, on its node
        assert all(after[rank] == first[rank] for rank in range(3)), (first, after)
        assert equal_replicas(cluster_kernel), "the new rank was given the live peers' model"
        trained = cluster_kernel.execute(TRAINING, interrupt_after=1.0, counted_from="training", timeout=60)
        assert "ranks 0-3 stopped after optimizer step" in trained.traceback, trained.traceback
        assert "each with the same steps applied" in trained.traceback, trained.traceback
        assert equal_replicas(cluster_kernel), "DDP trained on in every rank"
        os.kill(after[1][0], 9)
        told_between_cells(cluster_kernel, "taas: rank 1 killed by signal SIGKILL between cells")
        again = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert again[1][0] != after[1][0] and again[1][1] == after[1][1], (after, again)
        assert equal_replicas(cluster_kernel)
        assert "session:             up: 4 ranks" in cluster_kernel.execute("%taas").ok().stdout
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)


def test_a_session_on_the_cluster_shrinks_by_whole_nodes_and_grows_back_onto_the_nodes_it_holds(cluster_kernel):
    """`%taas resize 2` ends node 1's ranks (its node stays held for the session), `%taas resize 4` starts new ones
    there, given the model from a live peer: each time the same DDP model trains on, its replicas equal.
    Sizes that are not whole nodes, or more nodes than the session holds, are refused in one line."""
    cluster_kernel.execute(DDP_SESSION, timeout=240).ok()
    try:
        first = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        for refused, why in ((3, "whole nodes of 2 ranks: 2, 4, 6, …"), (6, "needs 1 more, the cluster has 2 in all")):
            said = cluster_kernel.execute(f"%taas resize {refused}").error["evalue"]
            assert said.startswith(f"%taas resize {refused}: ") and why in said, said
        said = cluster_kernel.execute("%taas resize 2", timeout=120).ok().stdout
        assert said.startswith("taas: the session has 2 ranks now: ranks 2-3 ended"), said
        assert not [pid for pid, _ in (first[2], first[3]) if alive_pid(pid)], "node 1's ranks are gone"
        trained = cluster_kernel.execute(TRAINING, interrupt_after=1.0, counted_from="training", timeout=60)
        assert "ranks 0-1 stopped after optimizer step" in trained.traceback, trained.traceback
        said = cluster_kernel.execute("%taas resize 4", timeout=180).ok().stdout
        assert said.startswith("taas: the session has 4 ranks now: ranks 2-3 joined"), said
        grown = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert grown[2][1] == first[2][1] and grown[2][0] != first[2][0], (first, grown)  # new, on the held node
        assert (grown[0], grown[1]) == (first[0], first[1])
        trains_on_with_equal_replicas(cluster_kernel, "ranks 0-3")
        r = cluster_kernel.execute("#pragma taas\nprint('world', os.environ['WORLD_SIZE'], dist.get_world_size())")
        assert r.ok().each_rank().count("world 4 4") == 4, r.each_rank()
        # What meets the grown ranks: a pull, a failure and its debugger, a death between cells, a shrink, a stop.
        cluster_kernel.execute("#pragma taas\nmine = dist.get_rank() * 10", timeout=60).ok()
        cluster_kernel.execute("%taas pull mine", timeout=60).ok()
        assert cluster_kernel.value("list(mine)") == [0, 10, 20, 30]
        r = cluster_kernel.execute("#pragma taas --ranks 3\nraise KeyError(f'on rank {mine}')", timeout=60)
        assert r.error["evalue"] == "rank 3 failed: KeyError: 'on rank 30'", r.error
        assert "[rank 3] 30" in cluster_kernel.execute("%taas debug", answers=["p mine", "q"], timeout=60).each_rank()
        os.kill(grown[2][0], 9)
        told_between_cells(cluster_kernel, "taas: rank 2 killed by signal SIGKILL between cells")
        healed = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert healed[2][1] == grown[2][1] and healed[2][0] != grown[2][0], (grown, healed)
        said = cluster_kernel.execute("%taas resize 2", timeout=120).ok().stdout
        assert said.startswith("taas: the session has 2 ranks now: ranks 2-3 ended"), said
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)


def test_a_session_on_the_cluster_grows_onto_a_node_it_did_not_start_with_and_lets_it_go_when_it_stops(
    cluster_kernel,
):
    """A one-node session `%taas resize 4`: the cluster's other t.2 node is held for it (a placement group of its
    own), its new ranks there are given the model from a live peer, and the same DDP model trains on over both nodes
    with equal replicas and torchrun's numbers. `%taas cluster release` spares the added node's agent; more nodes
    than the cluster has are refused in one line; shrunk, the session lets the node it added go back to the
    cluster, and grown again, holds it anew; stopped, it leaves no placement group."""
    one_node = DDP_SESSION.replace("--gpus 4", "--gpus 2")
    cluster_kernel.execute(one_node, timeout=240).ok()
    try:
        first = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        said = cluster_kernel.execute("%taas resize 4", timeout=180).ok().stdout
        assert said.startswith("taas: the session has 4 ranks now: ranks 2-3 joined"), said
        grown = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert grown[2][1] == grown[3][1] != first[0][1] and (grown[0], grown[1]) == (first[0], first[1]), grown
        shown = cluster_kernel.execute("%taas").ok().stdout
        assert "up: 4 ranks on cpu, configuration t.2, on 2 nodes of the cluster" in shown, shown
        numbers = "print('numbers', *(os.environ[n] for n in ('RANK', 'LOCAL_RANK', 'GROUP_RANK', 'GROUP_WORLD_SIZE')))"
        r = cluster_kernel.execute(f"#pragma taas\n{numbers}").ok()
        assert sorted(re.findall(r"numbers (\d \d \d \d)", r.stdout)) == ["0 0 0 2", "1 1 0 2", "2 0 1 2", "3 1 1 2"]
        trains_on_with_equal_replicas(cluster_kernel, "ranks 0-3")
        said = cluster_kernel.execute("%taas cluster release", timeout=60).ok().stdout
        assert "2 kept: they serve the running session" in said, said
        said = cluster_kernel.execute("%taas resize 6", timeout=60).error["evalue"]
        assert said.startswith("%taas resize 6: the session holds 2 nodes of t.2 and needs 1 more, the cluster has 2")
        assert len(placement_groups(cluster_kernel)) == 2, "the session's first, and the one its resize added"
        said = cluster_kernel.execute("%taas resize 2", timeout=120).ok().stdout
        assert said.startswith("taas: the session has 2 ranks now: ranks 2-3 ended"), said
        assert len(placement_groups(cluster_kernel)) == 1, "the node the resize added went back to the cluster"
        said = cluster_kernel.execute("%taas cluster release", timeout=60).ok().stdout
        assert "1 kept: it serves the running session" in said, said  # the given-back node's agent is idle
        said = cluster_kernel.execute("%taas resize 4", timeout=180).ok().stdout
        assert said.startswith("taas: the session has 4 ranks now: ranks 2-3 joined"), said
        again = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert again[2][1] == grown[2][1] and again[2][0] != grown[2][0], (grown, again)  # the only other t.2 node
        assert equal_replicas(cluster_kernel)
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)


NOTEBOOK_VALUES = (
    "nothing, nan, inf, empty = None, float('nan'), float('-inf'), {'a': [], 'b': (None,), 'c': set()}\n"
    "odd = torch.tensor([float('nan'), 0.0, float('inf')])"
)
SEEN = (
    "#pragma taas\n"
    "seen = (nothing is None, nan != nan, inf, empty, bool(odd[0].isnan()), float(odd[2]), dist.get_rank())\n"
    "print('seen', seen[:-1])\n"
    "nothing = None if dist.get_rank() == 0 else float('nan')"
)


def test_a_grown_cluster_session_meets_a_timeout_odd_notebook_values_and_a_reloaded_extension(cluster_kernel):
    """What a user does next in a session grown onto a node it did not start with: --timeout stops training in
    every rank after the same step, the grown ranks' too; notebook values that are None, NaN, infinite or empty
    reach every rank, the grown ones too, and what each rank bound comes back; %reload_ext keeps the grown session
    on its two nodes, and DDP trains on with equal replicas."""
    cluster_kernel.execute(DDP_SESSION.replace("--gpus 4", "--gpus 2"), timeout=240).ok()
    try:
        said = cluster_kernel.execute("%taas resize 4", timeout=180).ok().stdout
        assert said.startswith("taas: the session has 4 ranks now: ranks 2-3 joined"), said
        timed = cluster_kernel.execute(TRAINING.replace("#pragma taas", "#pragma taas --timeout 2"), timeout=60)
        assert timed.error is not None and timed.error["ename"] == "RunTimedOut", timed.traceback
        assert "ranks 0-3 stopped after optimizer step" in timed.traceback, timed.traceback
        assert equal_replicas(cluster_kernel)
        cluster_kernel.execute(NOTEBOOK_VALUES).ok()
        seen = cluster_kernel.execute(SEEN, timeout=60).ok().each_rank()
        expected = "seen (True, True, -inf, {'a': [], 'b': (None,), 'c': set()}, True, inf)"
        assert sorted(re.findall(r"\[rank (\d)\] (.*)", seen)) == [(str(r), expected) for r in range(4)], seen
        cluster_kernel.execute("%taas pull seen nothing", timeout=60).ok()
        assert cluster_kernel.value("[s[-1] for s in seen]") == [0, 1, 2, 3]
        assert cluster_kernel.value("[n is None for n in nothing]") == [True, False, False, False]
        assert cluster_kernel.value("[n != n for n in nothing]") == [False, True, True, True]
        cluster_kernel.execute("nothing = None\n%taas push nothing", timeout=60).ok()
        r = cluster_kernel.execute("#pragma taas\nprint('none', nothing is None)", timeout=60).ok()
        assert r.each_rank().count("none True") == 4, r.each_rank()
        cluster_kernel.execute("%reload_ext taas_magic").ok()
        shown = cluster_kernel.execute("%taas").ok().stdout
        assert "up: 4 ranks on cpu, configuration t.2, on 2 nodes of the cluster" in shown, shown
        trains_on_with_equal_replicas(cluster_kernel, "ranks 0-3")
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)


def alive_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


BACKGROUND_TRAINING = """#pragma taas --background
import time
steps, checksum = 0, 0.0
print('training', flush=True)
while steps < {steps}:
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    steps += 1
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    time.sleep(0.02)
"""


def test_cells_run_in_the_background_on_the_cluster_while_the_notebook_works_and_pulls_read_every_node(
    cluster_kernel,
):
    """A one-shot run and a session's cell in the background on the cluster: the notebook runs cells and asks the
    cluster meanwhile (the run's thread and the notebook's cells take turns with the driver), leaving the cluster
    is refused while a run holds agents there, `%taas pull` reads the ranks of both nodes at one optimizer step,
    and the names come back."""
    started = cluster_kernel.execute(
        header("--background")
        + INIT
        + "import time\nfor tick in range(30):\n    time.sleep(0.2)\nranks_seen = dist.get_world_size()",
        timeout=240,
    ).ok()
    assert re.fullmatch(
        r"taas run \d+ \(cell In\[\d+\], 4 ranks on cpu\): running for \d+ s", started.displays[-1]["text/plain"]
    )
    assert cluster_kernel.execute("print(sum(range(10)))").ok().stdout == "45\n"
    shown = cluster_kernel.execute("%taas cluster", timeout=60).ok().stdout
    assert "nodes" in shown, "the notebook asks the cluster while the run's thread polls it"
    refused = cluster_kernel.execute("%taas cluster off", timeout=60)
    assert refused.error is not None and re.fullmatch(
        r"run \d+ \(cell In\[\d+\]\) runs on the cluster in the background: %taas wait or %taas stop first, "
        r"then change the cluster",
        refused.error["evalue"],
    ), refused.error
    waited = cluster_kernel.execute("%taas wait", timeout=120).ok()
    assert re.search(r"ended after \d+ s; .*ranks_seen.* back in the notebook", waited.stderr), waited.stderr
    assert cluster_kernel.value("ranks_seen") == 4
    assert not leftovers(cluster_kernel)

    cluster_kernel.execute(
        header("--keep") + INIT + "import torch\n"
        "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.01)",
        timeout=240,
    ).ok()
    try:
        training = cluster_kernel.execute(BACKGROUND_TRAINING.format(steps=100_000), timeout=60).ok()
        cluster_kernel.execute("run = _").ok()
        time.sleep(3)  # a few steps in
        cluster_kernel.execute("%taas pull steps checksum --ranks 0-3", timeout=60).ok()
        steps, sums = cluster_kernel.value("(list(steps), list(checksum))")
        assert steps[0] > 0 and len(set(steps)) == 1, f"every rank of both nodes at one step: {steps}"
        assert len(set(sums)) == 1, f"and so the same weights: {sums}"
        assert cluster_kernel.value("run.done()") is False, "the training goes on"
        where = cluster_kernel.execute("%taas stacks", timeout=60).ok().stdout
        assert "Cell In[" in where and "waiting for the next cell" not in where, f"the training cell's lines: {where}"
        cluster_kernel.execute("run.stop()", timeout=90).ok()
        later = cluster_kernel.later[training.msg_id]
        assert "training" in later.stdout, "the ranks' output goes to the run's own cell"
        cluster_kernel.execute("%taas pull steps", timeout=60).ok()
        assert len(set(cluster_kernel.value("list(steps)"))) == 1, "stopped together, the session goes on"
    finally:
        cluster_kernel.execute("%taas stop", timeout=120).ok()
    assert not leftovers(cluster_kernel)


def test_the_kernels_shutdown_ends_a_run_in_the_background_on_the_cluster_and_leaves_nothing(cluster, cluster_kernel):
    """At the kernel's exit the extension ends what it runs, as `%unload_ext` does: a run in the background on the
    cluster is stopped and closed, its nodes' run folders removed and its placement released (its processes would
    end with the kernel anyway; those would stay until Ray noticed, or the node's next agent)."""
    local, config = cluster
    k = Kernel(
        {"TAAS_CLUSTER": local.address, "TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo"}, warm_fork_server=False
    )
    try:
        k.execute(
            header("--background") + "import time\nprint('started', flush=True)\ntime.sleep(600)",
            timeout=240,
        ).ok()
        deadline = time.monotonic() + 120
        while not rank_processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert rank_processes(), "the run's ranks started on the nodes"
        # As a front end shuts a kernel down: a shutdown request, then a kill if it has not exited. The wait is
        # long here: what is tested is what the kernel does as it exits, not how long a front end waits for it.
        k.client.stop_channels()
        k.manager.shutdown_wait_time = 60.0
        k.manager.shutdown_kernel(now=False)
    finally:
        k.shutdown()
    assert not leftovers(cluster_kernel), "the run was closed as the kernel exited, on every node"


def test_a_session_is_fed_from_the_cpu_node_pass_after_pass_from_cell_to_cell(cluster, registered):
    local, _ = cluster
    cluster_kernel = registered
    here = collected(
        cluster_kernel.execute("#pragma taas --gpus 4 --device cpu --on local\n" + COLLECT, timeout=120).ok()
    )
    late = "seen = [[b.tolist() for b in late] for _ in range(2)]\nprint('LATE ' + json.dumps(seen), flush=True)"
    cluster_kernel.execute(header("--keep --cpus 1") + "import json, taas", timeout=240).ok()
    try:
        cells = [cluster_kernel.execute("#pragma taas\n" + COLLECT, timeout=120).ok() for _ in range(2)]
        got = [collected(r) for r in cells]
        assert all(sorted(g) == [0, 1, 2, 3] and all(record["len"] == 4 for record in g.values()) for g in got)
        assert {rank: g["passes"] for rank, g in got[0].items()} == {rank: g["passes"] for rank, g in here.items()}, (
            "the session's first passes are a one-shot cell's, in the same order"
        )
        for number in range(2):
            union = [i for rank in range(4) for batch in got[1][rank]["passes"][number] for i in batch]
            assert sorted(set(union)) == list(range(50)) and len(union) == 62, "the next cell's passes are whole"
        head = int(local.addresses[0].split(".")[-1])
        assert {node for g in got for record in g.values() for node in record["built"]} == {head}, (
            "built on the CPU node alone"
        )
        assert re.search(r"taas: loader: 48 elements delivered to 4 ranks", cells[1].stderr), cells[1].stderr
        cluster_kernel.execute("late = DataLoader(Indices(20), batch_size=2, shuffle=True)\ntaas.register(late)").ok()
        served = cluster_kernel.execute("#pragma taas\n" + late, timeout=120).ok()
        batches = drawn_passes(served, "LATE")

        origins = {node for passes in batches.values() for p in passes for batch in p for _, node in batch}
        assert origins == {head}, "built on the CPU node"
        assert re.search(r"taas: late: 24 elements delivered to 4 ranks", served.stderr), served.stderr
        again = drawn_passes(cluster_kernel.execute("#pragma taas\n" + COLLECT.replace("loader", "late")).ok(), "GOT")
        assert again, "the next cell goes on with its stream"
        cluster_kernel.execute("%taas stop").ok()
        one_shot = drawn_passes(
            cluster_kernel.execute("#pragma taas --gpus 4 --device cpu --on local\n" + late, timeout=120).ok(), "LATE"
        )

        def indices(drawn: dict[int, list]) -> dict[int, list]:
            return {rank: [[[i for i, _ in batch] for batch in p] for p in passes] for rank, passes in drawn.items()}

        assert indices(batches) == indices(one_shot), (
            "a loader registered since the session started is served from its first pass, as a one-shot cell's"
        )
    finally:
        cluster_kernel.execute("%taas stop").ok()
        cluster_kernel.execute(
            "if any(loader is globals().get('late') for loader in taas.registered()):\n    taas.unregister(late)"
        ).ok()
    assert not leftovers(cluster_kernel)


def test_a_module_edited_during_a_session_is_reloaded_on_every_node_with_autoreload_on(cluster_kernel, shared_modules):
    module = shared_modules / "on_nodes.py"

    def write(value: int) -> None:  # a time that moves on by whole seconds: cached bytecode goes by them
        module.write_text(f"def f():\n    return {value}\n")
        os.utime(module, (1_700_000_000 + 10 * value,) * 2)

    write(1)
    cluster_kernel.execute("%load_ext autoreload\n%autoreload 2\nimport on_nodes").ok()
    try:
        r = cluster_kernel.execute(
            header("--keep") + "held = on_nodes.f\nprint('before', held(), flush=True)",
            timeout=240,
        ).ok()
        assert r.each_rank().count("before 1") == 4, r.stdout
        write(2)
        r = cluster_kernel.execute("#pragma taas --return none\nprint('after', on_nodes.f(), held())", timeout=60).ok()
        assert cluster_kernel.value("on_nodes.f()") == 2
        assert r.each_rank().count("after 2 2") == 4, r.stdout
        cluster_kernel.execute("%autoreload off").ok()
        write(3)
        r = cluster_kernel.execute("#pragma taas --return none\nprint('kept', on_nodes.f())", timeout=60).ok()
        assert cluster_kernel.value("on_nodes.f()") == 2
        assert r.each_rank().count("kept 2") == 4, r.stdout
    finally:
        cluster_kernel.execute("%taas stop\n%autoreload off").ok()
    assert not leftovers(cluster_kernel)


def test_interrupt_stops_every_rank_on_every_node(cluster_kernel):
    r = cluster_kernel.execute(
        HEADER + "print('sleeping', flush=True)\ntime.sleep(600)", timeout=60, interrupt_after=4.0
    )
    assert r.error is not None and "KeyboardInterrupt" in r.traceback, r.error
    assert "every rank stopped (ranks 0-3: KeyboardInterrupt)" in r.traceback
    assert r.seconds < 4.0 + 10
    assert not leftovers(cluster_kernel)
    cluster_kernel.execute(HEADER + "print('after')", timeout=60).ok()


def test_an_interrupt_while_the_agents_start_leaves_nothing_and_the_next_cell_runs(cluster_kernel):
    cluster_kernel.execute("%taas cluster release").ok()
    r = cluster_kernel.execute(HEADER + "print('never')", timeout=60, interrupt_after=1.0)
    assert r.error is not None and "KeyboardInterrupt" in r.error["ename"] and "never" not in r.stdout
    assert not leftovers(cluster_kernel)
    cluster_kernel.execute(HEADER + "print('after')", timeout=240).ok()


def test_a_name_that_cannot_travel_fails_the_cell_before_any_node_is_taken(cluster_kernel):
    cluster_kernel.execute("import threading\nlock = threading.Lock()").ok()
    r = cluster_kernel.execute(HEADER + "print(lock)", timeout=60)
    assert r.error is not None and "the cell needs 'lock'" in r.error["evalue"], r.error
    assert "cannot be sent to ranks on the cluster's nodes" in r.error["evalue"]
    assert not leftovers(cluster_kernel)


def test_a_name_that_cannot_be_rebuilt_on_a_node_fails_the_cell_in_one_line_and_the_next_cell_runs(cluster_kernel):
    """It pickles here and fails to unpickle there: the node's agent says why, in taas's own error, which
    must survive Ray's trip to the kernel (it came as Ray's "Failed to deserialize exception")."""
    cluster_kernel.execute(
        "import os\n"
        "def only_here(pid):\n"
        "    if os.getpid() != pid:\n"
        "        raise ValueError('made only in the notebook')\n"
        "    return 'fragile'\n"
        "class Fragile:\n"
        "    def __reduce__(self):\n"
        "        return only_here, (os.getpid(),)\n"
        "fragile = Fragile()"
    ).ok()
    r = cluster_kernel.execute(HEADER + "print(fragile)", timeout=240)
    assert r.error is not None and r.error["ename"] == "TaasRunError", r.error
    assert r.error["evalue"] == "the ranks could not be started: ValueError: made only in the notebook"
    assert "Ray" not in "".join(r.error["traceback"])
    assert not leftovers(cluster_kernel)
    cluster_kernel.execute(HEADER + "print('after')", timeout=240).ok()


def test_every_kind_of_notebook_value_reaches_the_nodes_and_comes_back(cluster_kernel):
    """None, NaN, mocks, modules, objects whose ``__eq__`` raises… (notebook_values.py) are read by a
    cell on two nodes and by a configuration line alone on a CPU node; the generator, which cannot
    travel, is named in one line, before any node is taken."""
    everything = {f"v_{kind}": expression for kind, expression in KINDS.items()}
    picklable = {name: expression for name, expression in everything.items() if not unpicklable(expression)}
    cluster_kernel.execute(SETUP + "".join(f"{name} = {expression}\n" for name, expression in everything.items())).ok()
    reads = ", ".join(picklable)
    r = cluster_kernel.execute(
        HEADER + f"print('kinds', [type(v).__name__ for v in ({', '.join(everything)},)])", timeout=60
    )
    assert r.error is not None and r.error["evalue"].startswith("the cell needs 'v_generator'"), r.error
    assert not leftovers(cluster_kernel)
    expected = cluster_kernel.value(f"[type(v).__name__ for v in ({reads},)]")
    r = cluster_kernel.execute(
        HEADER
        + f"print('kinds', [type(v).__name__ for v in ({reads},)], flush=True)\n"
        + "".join(f"back_{name} = {name}\n" for name in picklable),
        timeout=240,
    ).ok()
    assert r.each_rank().count(f"kinds {expected!r}") == 4, r.stdout
    assert (
        cluster_kernel.value(f"[type(b).__name__ for b in ({', '.join('back_' + n for n in picklable)},)]") == expected
    )
    r = cluster_kernel.execute("#!c1.4\nprint('alone', type(v_none).__name__, v_nan != v_nan)", timeout=60).ok()
    assert "alone NoneType True" in r.stdout
    assert not leftovers(cluster_kernel)


def test_a_run_that_needs_more_nodes_than_the_cluster_has_is_refused_in_one_line(cluster_kernel):
    r = cluster_kernel.execute("#!t.2\n#pragma taas --gpus 8 --device cpu\nprint('never')", timeout=30)
    assert r.error is not None and r.error["ename"] == "TaasUsageError"
    assert "4 nodes of t.2 needed, the cluster has 2" in r.error["evalue"]
    assert r.seconds < 10 and "never" not in r.stdout
    r = cluster_kernel.execute("#!t.2\n#pragma taas --gpus 3 --device cpu\npass", timeout=30)
    assert "--gpus 3 does not fit t.2 (2 GPUs per node): use 1-2, 4 or 8" in r.error["evalue"]


def test_lightning_ddp_spans_the_nodes_without_process_group_code(cluster_kernel):
    from support.cells import REGRESSION

    cluster_kernel.execute(REGRESSION).ok()
    r = cluster_kernel.execute(
        HEADER
        + """\
model = Regression()
trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", max_epochs=2, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(TensorDataset(X, Y), batch_size=32))
w = [round(v, 3) for v in model.layer.weight.detach().flatten().tolist()]
print("RESULT", trainer.global_rank, trainer.node_rank, trainer.world_size, w)
""",
        timeout=240,
    ).ok()
    lines = sorted(line.split("RESULT ", 1)[1] for line in r.stdout.splitlines() if "RESULT" in line)
    assert [line.split()[:3] for line in lines] == [["0", "0", "4"], ["1", "0", "4"], ["2", "1", "4"], ["3", "1", "4"]]
    assert len({line.split(" ", 3)[3] for line in lines}) == 1, "DDP kept every rank's weights identical"
    assert cluster_kernel.value("str(w)") == lines[0].split(" ", 3)[3]


def test_a_configuration_line_alone_runs_the_cell_as_one_process_on_such_a_node(cluster, cluster_kernel):
    local, _ = cluster
    cluster_kernel.execute("numbers = list(range(10))").ok()
    r = cluster_kernel.execute(
        "#!c1.4\nprint('on', os.environ['MASTER_ADDR'], os.environ['WORLD_SIZE'])\ntotal = sum(numbers)", timeout=240
    ).ok()
    assert r.stdout.strip() == f"on {local.addresses[0]} 1"  # unlabelled: one process, no [rank 0]
    assert cluster_kernel.value("total") == 45


def test_a_save_under_an_absolute_path_stays_on_the_node_and_the_cell_says_so(cluster, cluster_kernel, tmp_path):
    target = tmp_path / "elsewhere.pt"
    r = cluster_kernel.execute(HEADER + f"torch.save({{'a': 1}}, {str(target)!r})", timeout=120).ok()
    assert f"taas: rank 0 saved {target} on node {network(cluster[0].addresses)}" in r.stderr
    assert "stays on its node" in r.stderr
    assert "copied into this notebook's folder" not in r.stderr


def test_a_run_waits_briefly_for_busy_nodes_then_says_how_many_are_free(cluster, cluster_kernel):
    cluster_kernel.execute(
        own_ray(cluster[0].address) + "held = ray.util.placement_group([{'taas:t.2': 1}])\nheld.wait(10)"
    ).ok()
    try:
        r = cluster_kernel.execute(HEADER + "print('never')", timeout=60)
        assert r.error is not None and "2 nodes of t.2 needed, 1 of the cluster's 2 are free now" in r.error["evalue"]
        assert r.seconds < 12 and "never" not in r.stdout
    finally:
        cluster_kernel.execute("ray.util.remove_placement_group(held)").ok()
    cluster_kernel.execute(HEADER + "print('free again')", timeout=60).ok()


def test_timeout_shows_where_each_rank_of_each_node_was(cluster_kernel):
    r = cluster_kernel.execute(
        "#!t.2\n#pragma taas --gpus 4 --device cpu --timeout 3\ndef wait_here():\n    time.sleep(600)\nwait_here()",
        timeout=60,
    )
    assert r.error is not None and "--timeout 3 s elapsed: ranks 0-3 still running" in r.error["evalue"]
    assert "ranks 0-3 (nodes 0, 1): in no collective:" in r.traceback, r.traceback
    assert r.traceback.count("in wait_here") == 1, "one place, shown once for the ranks of both nodes"
    assert not leftovers(cluster_kernel)


def test_a_hang_across_nodes_is_diagnosed_with_each_rank_s_node(cluster_kernel):
    r = cluster_kernel.execute(
        header("--hang-after 3 --timeout 15")
        + INIT
        + """\
import time
if dist.get_rank() != 3:
    dist.barrier()
time.sleep(60)
""",
        timeout=120,
    )
    shown = ANSI.sub("", r.stderr)
    assert (
        "taas: no progress for 3 s: rank 3 has not entered barrier #1 that ranks 0-2 wait in; it is at Cell In["
        in shown
    ), shown
    assert "ranks 0-2 (nodes 0, 1): in barrier #1 for" in shown, shown
    assert "rank 3 (node 1): in no collective:" in shown, shown
    assert "time.sleep(60)" in shown
    assert r.error is not None and r.error["ename"] == "RunTimedOut"
    assert "ranks 0-2 (nodes 0, 1): in barrier #1" in ANSI.sub("", r.traceback)
    assert not leftovers(cluster_kernel)


def test_on_local_runs_on_this_machine_while_connected(cluster_kernel):
    r = cluster_kernel.execute("#pragma taas --gpus 2 --device cpu --on local\nprint(os.environ['MASTER_ADDR'])").ok()
    assert r.each_rank().count("127.0.0.1") == 2


def test_cluster_command_shows_nodes_by_configuration(cluster, cluster_kernel):
    local, _ = cluster
    cluster_kernel.execute(HEADER + "pass", timeout=240).ok()  # the agents are warm after a cell
    r = cluster_kernel.execute("%taas cluster").ok()
    assert f"connected to the Ray cluster at {local.address}: 3 nodes" in r.stdout
    assert re.search(r"t\.2: 2 nodes \(2 free, 2 with a warm agent\)", r.stdout), r.stdout
    assert "c1.4: 1 node" in r.stdout
    assert f"cluster:             {local.address} (cells run there" in cluster_kernel.execute("%taas").ok().stdout


def test_a_mistyped_address_keeps_the_working_connection_and_its_warm_agents(cluster, cluster_kernel):
    local, _ = cluster
    cluster_kernel.execute(HEADER + "pass", timeout=240).ok()  # the agents are warm after a cell
    typo = cluster_kernel.execute("%taas cluster 127.0.0.2:1", timeout=30)
    assert typo.error["evalue"].startswith("nothing answers at 127.0.0.2:1 (Connection refused)"), typo.error
    scheme = cluster_kernel.execute(f"%taas cluster http://{local.address}")
    assert scheme.error["evalue"] == (
        f"cluster address 'http://{local.address}' is not HOST:PORT, ray://HOST:PORT or auto: leave out http:// "
        f"(%taas cluster {local.address})"
    )
    shown = cluster_kernel.execute("%taas cluster").ok().stdout
    assert f"connected to the Ray cluster at {local.address}" in shown and "2 with a warm agent" in shown, shown
    cluster_kernel.execute(HEADER + "pass", timeout=240).ok()


def test_localhost_where_the_head_is_on_another_loopback_address_is_one_line_and_keeps_the_connection(
    cluster, cluster_kernel
):
    """The head listens on every address, so localhost answers; but the notebook's Ray connects through a
    node at the address it names, and none is at 127.0.0.1: Ray waited a minute, then said ConnectionError."""
    local, _ = cluster
    port = local.address.rpartition(":")[2]
    r = cluster_kernel.execute(f"%taas cluster localhost:{port}", timeout=120)
    assert r.error is not None and r.seconds < 20, (r.error, r.seconds)
    assert r.error["evalue"] == (
        f"no node of the Ray cluster at localhost:{port} is at 127.0.0.1 (localhost), so this notebook cannot "
        f"connect through it: its head is at {local.addresses[0]} (%taas cluster {local.address})"
    ), r.error
    shown = cluster_kernel.execute("%taas cluster").ok().stdout
    assert f"connected to the Ray cluster at {local.address}" in shown, shown


SERVED_TRAINING = (
    """#pragma taas
took = []
for b in loader:
    took.append(b[:, 0].tolist())
    model(b.float()).square().mean().backward()
    opt.step()
    opt.zero_grad()
    steps += 1
    if dist.get_rank() == 3 and len(took) == KILL_AT:
        time.sleep(1)  # the producers fill its window: then it takes in what waits, which dies with it
        loader._take_in_waiting()
        os.kill(os.getpid(), signal.SIGKILL)
print("TOOK " + json.dumps(took), flush=True)
"""
    + GATHERED_STATE
)


@pytest.mark.parametrize("producers", ["cpu node", "rank nodes"])
def test_a_cluster_session_fed_by_producers_heals_a_killed_rank_which_takes_over_its_share(registered, producers):
    """DDP training over a registered loader fed from the CPU node (or by producers on both nodes of ranks), rank
    3 (node 1) killed in the middle of a pass, holding elements of the next pass that arrived early: a new process
    takes its place on its node and its share of the stream, the elements the dead process had received built again
    there (their producers' counters, on other nodes, copied in first), and the next pass trains every rank on the
    batches a one-shot run gives it, with equal replicas. Rank 1 (node 0) killed between cells, and rank 3 in a cell
    that trains in the background: the same."""
    cluster_kernel = registered
    options = "--keep --cpus 1"
    if producers == "rank nodes":  # a configuration the cluster lacks for producer nodes: they take turns on these
        cluster_kernel.execute("import taas_magic.kernel.cluster_link as _link\n_link.PRODUCER_NODE = 'c1.80'").ok()
        options = "--keep --cpus 2"
    reference = "#pragma taas --gpus 4 --device cpu --on local\nimport json\n"
    reference += "print('PASSES ' + json.dumps([[b[:, 0].tolist() for b in loader] for _ in range(5)]))"
    passes = drawn_passes(cluster_kernel.execute(reference).ok(), "PASSES")
    start = header(options) + INIT + "import json, signal, time\ntorch.manual_seed(0)\n"
    start += "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
    start += "opt = torch.optim.SGD(model.parameters(), lr=1e-6)\nsteps = 0"
    cluster_kernel.execute(start, timeout=240).ok()
    try:
        first = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        died = cluster_kernel.execute(SERVED_TRAINING.replace("KILL_AT", "2"), timeout=120)
        assert died.error is not None and "rank 3 failed: killed by signal SIGKILL" in died.error["evalue"], died.error
        assert "taas: the session goes on, a new process in place of rank 3" in died.traceback, died.traceback
        rebuilt = re.search(
            r"taas: rank 3: its share of 'loader' goes on at pass 1 \((\d+) elements the process", died.stderr
        )
        assert rebuilt and int(rebuilt[1]) > 0, died.stderr
        after = cluster_kernel.execute(SERVED_TRAINING.replace("KILL_AT", "-1"), timeout=120).ok()
        assert drawn_passes(after, "TOOK") == {rank: passes[rank][1] for rank in range(4)}, (
            "pass 1, whole, as a one-shot run's"
        )
        assert replicas_equal(after), after.stdout
        healed = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert healed[3][1] == first[3][1] and healed[3][0] != first[3][0], (first, healed)
        os.kill(healed[1][0], 9)  # on node 0, which serves the run's store (and hosts a producer, or not)
        told_between_cells(cluster_kernel, "taas: rank 1 killed by signal SIGKILL between cells")
        again = cluster_kernel.execute(SERVED_TRAINING.replace("KILL_AT", "-1"), timeout=120).ok()
        assert drawn_passes(again, "TOOK") == {rank: passes[rank][2] for rank in range(4)}, "pass 2, whole"
        assert replicas_equal(again), again.stdout
        assert where(cluster_kernel.execute(WHERE, timeout=60).ok())[1][1] == first[1][1], "on its node"
        background = SERVED_TRAINING.replace("#pragma taas", "#pragma taas --background").replace("KILL_AT", "2")
        cluster_kernel.execute(background, timeout=60).ok()
        waited = cluster_kernel.execute("%taas wait", timeout=120)
        assert "rank 3 failed: killed by signal SIGKILL" in waited.stderr, waited.stderr
        last = cluster_kernel.execute(SERVED_TRAINING.replace("KILL_AT", "-1"), timeout=120).ok()
        assert drawn_passes(last, "TOOK") == {rank: passes[rank][4] for rank in range(4)}, "pass 4, whole"
        assert replicas_equal(last), last.stdout
    finally:
        cluster_kernel.execute("%taas stop").ok()
        if producers == "rank nodes":
            cluster_kernel.execute("_link.PRODUCER_NODE = 'c1.4'").ok()
    assert not leftovers(cluster_kernel)


def test_a_loader_registered_during_a_cluster_session_is_served_on_the_ranks_nodes_and_heals_with_the_session(
    registered,
):
    """A loader registered after a cluster session started, whose producers take turns on the nodes of its ranks (no
    CPU node to host them): the cell that first uses it starts them, each node's share of its channels made by the
    node's agent; DDP trains over it beside the session's first loader; rank 3 killed in the middle of one of its
    passes takes over its share of both loaders; every pass is a one-shot run's, and the replicas stay equal."""
    cluster_kernel = registered
    cluster_kernel.execute("import taas_magic.kernel.cluster_link as _link\n_link.PRODUCER_NODE = 'c1.80'").ok()
    start = header("--keep --cpus 1") + INIT + "import json, signal, time\ntorch.manual_seed(0)\n"
    start += "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
    start += "opt = torch.optim.SGD(model.parameters(), lr=1e-6)\nsteps = 0"
    training = SERVED_TRAINING.replace("for b in loader:", "for b in late:")
    try:
        cluster_kernel.execute(start, timeout=240).ok()
        cluster_kernel.execute("late = DataLoader(Indices(30), batch_size=3, shuffle=True)\ntaas.register(late)").ok()
        first = cluster_kernel.execute(training.replace("KILL_AT", "-1"), timeout=120).ok()
        assert replicas_equal(first), first.stdout
        died = cluster_kernel.execute(training.replace("KILL_AT", "2"), timeout=120)
        assert died.error is not None and "rank 3 failed: killed by signal SIGKILL" in died.error["evalue"], died.error
        assert "[rank 3] taas: rank 3: its share of 'late' goes on at pass 2" in died.stderr, died.stderr
        after = cluster_kernel.execute(training.replace("KILL_AT", "-1"), timeout=120).ok()
        assert replicas_equal(after), after.stdout
        served = cluster_kernel.execute(SERVED_TRAINING.replace("KILL_AT", "-1"), timeout=120).ok()
        assert replicas_equal(served), "the session's first loader goes on too"
        passes_seen = cluster_kernel.execute(training.replace("KILL_AT", "-1"), timeout=120).ok()
        running = len(rank_processes())  # supervisors, ranks, producers on both nodes
        rebind = "old_late = late\nlate = DataLoader(Indices(12), batch_size=2)\ntaas.register(late)"
        cluster_kernel.execute(rebind).ok()  # the next cell is served the new loader, the old one's producers end
        rebound = cluster_kernel.execute(training.replace("KILL_AT", "-1"), timeout=120).ok()
        drawn = drawn_passes(rebound, "TOOK")  # 6 batches among 4 ranks, 2 each: the pass is padded with 2 of them
        assert sorted(drawn) == [0, 1, 2, 3]
        assert {i for took in drawn.values() for batch in took for i in batch} == set(range(12))
        assert "taas: late: 8 elements delivered to 4 ranks" in rebound.stderr, rebound.stderr
        again = cluster_kernel.execute(SERVED_TRAINING.replace("KILL_AT", "-1"), timeout=120).ok()
        assert replicas_equal(again), "the session goes on"
        deadline = time.monotonic() + 10
        while len(rank_processes()) != running and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(rank_processes()) == running, "the rebound name's old producer ended, its new one runs"
        cluster_kernel.execute("%taas stop").ok()
        cluster_kernel.execute("taas.unregister(late)\nlate = old_late").ok()
        reference = "#pragma taas --gpus 4 --device cpu --on local\nimport json\n"
        reference += "print('PASSES ' + json.dumps([[b[:, 0].tolist() for b in late] for _ in range(4)]))"
        passes = drawn_passes(cluster_kernel.execute(reference).ok(), "PASSES")
        assert drawn_passes(first, "TOOK") == {rank: passes[rank][0] for rank in range(4)}, "pass 0, a one-shot's"
        assert drawn_passes(after, "TOOK") == {rank: passes[rank][2] for rank in range(4)}, "pass 2, whole"
        assert drawn_passes(passes_seen, "TOOK") == {rank: passes[rank][3] for rank in range(4)}, "pass 3"
    finally:
        cluster_kernel.execute("%taas stop").ok()
        cluster_kernel.execute("_link.PRODUCER_NODE = 'c1.4'\ntaas.unregister(late)").ok()
    assert not leftovers(cluster_kernel)


def test_a_served_cluster_session_meets_an_interrupt_two_deaths_at_once_and_a_pull_in_the_background(registered):
    """What a user of a cluster session fed by producers meets beside a death: an interrupt in the middle of a pass
    (the rest of that pass skipped, the next one whole), ranks on both nodes killed at once (each replaced on its
    node, taking over its share), and `%taas pull` while the session trains in the background (every rank at one
    step); after each, the next pass gives every rank a one-shot run's batches, and the replicas are equal."""
    cluster_kernel = registered
    reference = "#pragma taas --gpus 4 --device cpu --on local\nimport json\n"
    reference += "print('PASSES ' + json.dumps([[b[:, 0].tolist() for b in loader] for _ in range(6)]))"
    passes = drawn_passes(cluster_kernel.execute(reference).ok(), "PASSES")
    start = header("--keep --cpus 1") + INIT + "import json, signal, time\ntorch.manual_seed(0)\n"
    start += "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
    start += "opt = torch.optim.SGD(model.parameters(), lr=1e-6)\nsteps = 0"
    cluster_kernel.execute(start, timeout=240).ok()
    slow = SERVED_TRAINING.replace("KILL_AT", "-1").replace("steps += 1", "steps += 1\n    time.sleep(1.0)")
    whole = SERVED_TRAINING.replace("KILL_AT", "-1")

    def next_pass_whole(number: int) -> None:
        after = cluster_kernel.execute(whole, timeout=120).ok()
        assert drawn_passes(after, "TOOK") == {rank: passes[rank][number] for rank in range(4)}, f"pass {number}"
        assert replicas_equal(after), after.stdout

    try:
        first = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        cut = cluster_kernel.execute(slow, timeout=60, interrupt_after=1.5)
        assert cut.error is not None and cut.error["ename"] == "RunInterrupted", cut.error
        assert "the session goes on" in cut.error["evalue"], cut.error
        next_pass_whole(1)
        two = SERVED_TRAINING.replace("dist.get_rank() == 3", "dist.get_rank() in (1, 3)").replace("KILL_AT", "2")
        died = cluster_kernel.execute(two, timeout=120)
        assert died.error is not None and "killed by signal SIGKILL" in died.error["evalue"], died.error
        assert "taas: the session goes on, a new process in place of ranks 1,3" in died.traceback, died.traceback
        for rank in (1, 3):
            assert f"[rank {rank}] taas: rank {rank}: its share of 'loader' goes on at pass 3" in died.stderr, rank
        next_pass_whole(3)
        healed = where(cluster_kernel.execute(WHERE, timeout=60).ok())
        assert all(healed[rank][0] != first[rank][0] and healed[rank][1] == first[rank][1] for rank in (1, 3))
        cluster_kernel.execute(slow.replace("#pragma taas", "#pragma taas --background"), timeout=60).ok()
        time.sleep(1.5)
        cluster_kernel.execute("%taas pull steps --ranks 0-3", timeout=60).ok()
        steps = cluster_kernel.value("list(steps)")
        assert len(set(steps)) == 1, f"every rank at one step: {steps}"
        cluster_kernel.execute("%taas wait", timeout=120).ok()
        next_pass_whole(5)
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)


@pytest.mark.timeout(300)  # a first Ray Client connection starts a server and a worker on the head
def test_a_notebook_off_the_cluster_connects_through_ray_client(cluster, registered, tmp_path):
    """Ray Client (ray://HOST:PORT): the same cells, the notebook's folder on the nodes (the kernel
    uploads it without holding the package: that call would wait forever through Ray Client), warm
    agents, delivery and node list; the connected kernel (cluster_kernel) stays idle meanwhile."""
    local, config = cluster
    pytest.importorskip("grpc")  # ray[client]
    k = Kernel({"TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo"}, warm_fork_server=False)
    try:
        (tmp_path / "clientmod.py").write_text("VALUE = 3\n")  # the notebook's folder goes up through Ray Client
        k.execute(f"os.chdir({str(tmp_path)!r})").ok()
        r = k.execute(f"%taas cluster {local.client_address}", timeout=120).ok()
        assert f"connected to the Ray cluster at {local.client_address}: 3 nodes" in r.stdout
        assert re.search(r"t\.2: 2 nodes \(2 free, 0 with a warm agent\)", r.stdout), r.stdout
        k.execute(
            HEADER + INIT + "import clientmod\nx = torch.ones(1) * clientmod.VALUE\ndist.all_reduce(x)\n"
            "total = int(x.item())\ndist.destroy_process_group()",
            timeout=240,
        ).ok()
        assert k.value("total") == 12
        warm = k.execute(HEADER + "pass", timeout=60).ok()
        assert warm.seconds < 5, warm.seconds  # about 0.3 s on an idle 2-core machine
        k.execute(DATA).ok()
        got = collected(k.execute(HEADER + COLLECT, timeout=240).ok())
        assert [len(got[rank]["passes"][0]) for rank in range(4)] == [4] * 4
        # Ray Client's gRPC threads are the cluster driver's, not the kernel's: ranks forked from it have none
        local = k.execute(
            "#pragma taas --gpus 2 --device cpu --on local\nimport os\nprint(sorted({open("
            "f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')}))"
        ).ok()
        assert "gRPC runs threads in this kernel" not in local.stderr, local.stderr
        assert "event_engine" not in local.stdout and "lifeguard" not in local.stdout, local.stdout
        k.execute("%taas cluster off").ok()
    finally:
        k.shutdown()
    assert not leftovers(registered)


def test_nodes_whose_free_resources_the_cluster_did_not_report_count_as_unknown_not_busy():
    """Through Ray Client a task reports what is free; one that did not answer in time says nothing."""
    from taas_magic.configurations import load_catalog
    from taas_magic.launch.cluster.nodes import Node, free_count

    shape = load_catalog().get("g2.8")
    free = Node("a", "127.0.0.2", {"taas:g2.8": 1, "GPU": 8}, {"taas:g2.8": 1, "GPU": 8})
    busy = Node("b", "127.0.0.3", {"taas:g2.8": 1, "GPU": 8}, {"GPU": 0})
    unreported = Node("c", "127.0.0.4", {"taas:g2.8": 1, "GPU": 8}, None)
    assert free_count([free, busy], shape) == 1
    assert free_count([free, unreported], shape) is None
    assert not unreported.free_for(shape)


def test_without_ray_installed_connecting_says_how_to_install_it(cluster, tmp_path):
    """A kernel where `import ray` fails, as where it is not installed: its cluster driver, which imports Ray,
    says so (where Ray is not installed at all, the kernel says it before starting one)."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    k = Kernel(
        {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}, warm_fork_server=False
    )
    try:
        r = k.execute(f"%taas cluster {cluster[0].address}", timeout=120)
        assert (
            r.error is not None and r.error["evalue"] == "running on a cluster needs Ray: pip install 'taas-magic[ray]'"
        )
        k.execute("#pragma taas --gpus 2\nprint('here')").ok()  # still usable on this machine
    finally:
        k.shutdown()


@pytest.mark.timing
def test_an_address_where_nothing_answers_is_one_line_at_once_and_the_kernel_stays_here():
    k = Kernel(warm_fork_server=False)
    try:
        r = k.execute("%taas cluster 127.0.0.9:1", timeout=30)
        assert r.error is not None and r.error["evalue"].startswith(
            "nothing answers at 127.0.0.9:1 (Connection refused)"
        )
        assert r.seconds < 10
        assert "cluster:             none" in k.execute("%taas").ok().stdout
        k.execute("#pragma taas --gpus 2\nprint('here')").ok()
    finally:
        k.shutdown()


def test_nothing_of_the_cluster_talked_beyond_loopback_but_name_lookups(cluster, peers):
    """Last in this module: through everything above (start, runs, data, sessions, failures), no process of
    the cluster or of taas had a peer beyond loopback other than the machine's name server; nobody reached
    out. test_cluster_nodes.py says the same of its own cluster, lost nodes and a dead kernel."""
    assert not peers.beyond_loopback(), peers.beyond_loopback()
