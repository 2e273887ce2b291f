"""A cluster's nodes and connections, on a real Ray cluster on this machine: a notebook without the
cluster's token, nodes lost mid-run, a dead kernel, sessions whose
agents or connection went; and that through all of it nothing talked beyond loopback.

Its cluster is its own worker's (tests/e2e/cluster/conftest.py): it adds and kills nodes, which the
runs of test_cluster.py must not meet.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
from support.cluster import (
    COLLECT,
    HEADER,
    INIT,
    alive,
    error_of,
    first_match,
    header,
    leftovers,
    network,
    node_agents,
    own_ray,
    placement_groups,
    rank_processes,
    raylet_of,
    raylets,
    taas_on,
)
from support.kernel import Kernel

ray = pytest.importorskip("ray")


def test_a_cluster_that_requires_a_token_says_in_one_line_what_a_notebook_lacks_then_connects_with_it(cluster):
    """The test cluster requires Ray's token authentication (LocalCluster's own token). A notebook without
    RAY_AUTH_MODE=token, or with another token, is told so in one line at once (Ray alone retries for 20 s
    and says only that it could not connect); once it sets the right token, the same kernel connects."""
    local, config = cluster
    if not hasattr(pytest.importorskip("ray.exceptions"), "AuthenticationError"):
        pytest.skip("Ray before 2.52 has no token authentication")
    k = Kernel(
        {"TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo", "RAY_AUTH_MODE": None, "RAY_AUTH_TOKEN": None},
        warm_fork_server=False,
    )
    try:
        k.execute("import ray").ok()  # seconds on a busy machine, which the connection's time must not count
        r = k.execute(f"%taas cluster {local.address}", timeout=120)
        assert r.error is not None and r.seconds < 15, r.seconds
        line = r.error["evalue"]
        assert f"the Ray cluster at {local.address} requires token authentication: set RAY_AUTH_MODE=token" in line
        assert "RAY_AUTH_TOKEN" in line and "\n" not in line
        assert "gcs_client" not in r.stderr, r.stderr  # Ray's own logging of the refusal: taas's line says it
        # Token mode and no token anywhere Ray looks: Ray's own check aborts the process it runs in, the kernel.
        k.execute("%env RAY_AUTH_MODE=token\n%env RAY_AUTH_TOKEN_PATH=/nonexistent/auth_token").ok()
        r = k.execute(f"%taas cluster {local.address}", timeout=120)
        assert r.error is not None and r.error["evalue"].startswith(
            f"the Ray cluster at {local.address} requires a token and this notebook has none: put it in"
        ), r.error
        assert k.execute("print('the kernel is alive')").ok().stdout == "the kernel is alive\n"
        k.execute("%env RAY_AUTH_TOKEN=" + "0" * 64).ok()
        r = k.execute(f"%taas cluster {local.address}", timeout=120)
        assert r.error is not None and r.seconds < 15, r.seconds
        assert "refused this notebook's token (from RAY_AUTH_TOKEN): it is not the cluster's" in r.error["evalue"]
        k.execute(f"%env RAY_AUTH_TOKEN={local.token}").ok()
        r = k.execute(f"%taas cluster {local.address}", timeout=120).ok()
        assert f"connected to the Ray cluster at {local.address}: 3 nodes" in r.stdout
        k.execute(HEADER + "import torch\nx = torch.ones(1)", timeout=240).ok()
        k.execute("%taas cluster off").ok()
    finally:
        k.shutdown()


# -- kernel-level commands while a session runs on the cluster ------------------------------------
SESSION = header("--keep") + INIT + "mine = dist.get_rank()\n"


def test_cluster_commands_leave_a_running_session_alone_or_refuse_in_one_line(cluster, cluster_kernel):
    local, _ = cluster
    cluster_kernel.execute(SESSION, timeout=240).ok()
    try:
        r = cluster_kernel.execute("%taas cluster release").ok()
        kept = re.fullmatch(
            r"taas: 0 warm agents released; (\d) kept: they serve the running session "
            r"\(%taas stop ends it\)",
            r.stdout.strip(),
        )
        assert kept and int(kept[1]) >= 2, r.stdout  # its 2 nodes (and a node of its data producers, if any)
        for command in ("%taas cluster off", f"%taas cluster {local.address}"):
            r = cluster_kernel.execute(command, timeout=60)
            assert r.error is not None and r.error["evalue"] == (
                "a session runs on the cluster (4 ranks): %taas stop first, then change the cluster"
            ), r.error
        cluster_kernel.execute("%reload_ext taas_magic").ok()
        r = cluster_kernel.execute(
            "#pragma taas\nx = torch.ones(1) * mine\ndist.all_reduce(x)\ntotal = x.item()", timeout=60
        ).ok()
        assert cluster_kernel.value("total") == 6.0, "the session's ranks on both nodes still work together"
    finally:
        cluster_kernel.execute("%taas stop").ok()
    assert not leftovers(cluster_kernel)
    released = cluster_kernel.execute("%taas cluster release").ok().stdout.strip()
    assert released == f"taas: {kept[1]} warm agents released", "idle once the session is over"


def test_stop_ends_a_session_whose_agents_died_in_one_line(cluster, cluster_kernel):
    nodes = network(cluster[0].addresses)
    others = {p.pid for p in node_agents()}
    cluster_kernel.execute("%taas cluster release").ok()
    cluster_kernel.execute(SESSION, timeout=240).ok()
    try:
        agents = [p for p in node_agents() if p.pid not in others]
        assert len(agents) >= 2, "one on each of the session's nodes"
        for agent in agents:
            agent.kill()
        psutil.wait_procs(agents, timeout=10)
        shown = cluster_kernel.execute("%taas", timeout=60).ok().stdout
        assert f"session:             ended: node {nodes}" in shown and "its agent died" in shown, shown
    finally:
        r = cluster_kernel.execute("%taas stop", timeout=60).ok()
    assert r.stdout.startswith(f"taas: the session had already ended (node {nodes}"), r.stdout
    cluster_kernel.execute(HEADER + "print('after')", timeout=240).ok()
    assert not leftovers(cluster_kernel)


def test_taas_and_stop_say_in_one_line_that_a_session_is_over_when_the_connection_is_gone(cluster):
    local, config = cluster
    k = Kernel(
        {"TAAS_CLUSTER": local.address, "TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo"}, warm_fork_server=False
    )
    try:
        k.execute(SESSION, timeout=240).ok()
        assert k.value("'ray' in sys.modules") is False, "Ray is the cluster driver's, not the kernel's"
        k.cluster_driver().kill()  # as Ray's driver ends itself when the cluster went away
        shown = k.execute("%taas", timeout=60).ok().stdout
        assert (
            f"session:             ended: the connection to the Ray cluster at {local.address} was lost "
            "(its driver process was killed by SIGKILL)" in shown
        ), shown
        r = k.execute("%taas stop", timeout=60).ok()
        assert r.stdout.startswith("taas: the session had already ended (the connection to the Ray cluster"), r.stdout
        assert "\n" not in r.stdout.strip(), r.stdout
    finally:
        k.shutdown()


def test_a_cluster_that_stops_costs_the_connection_not_the_kernel(cluster):
    """Ray's driver ends its own process when the cluster's head has been gone for a while: a minute by
    default, 3 s here (RAY_gcs_rpc_server_reconnect_timeout_s, which Ray's driver reads). That process is
    taas's cluster driver, not the kernel: the notebook keeps its names, its next cluster cell says in one
    line that the connection was lost and how to go on, and it connects again in the same kernel."""
    local, config = cluster
    k = Kernel(
        {"TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo", "RAY_gcs_rpc_server_reconnect_timeout_s": "3"},
        warm_fork_server=False,
    )
    own_head = network(local.addresses) + "200"  # addresses of its own on this worker's block
    one_node = "#!t.2\n#pragma taas --gpus 2 --device cpu\n"
    try:
        k.execute(
            f"""
import os
from taas_magic.local_cluster import LocalCluster
own = LocalCluster({{"t.2": 1}}, first_address={own_head!r})
os.environ.update(own.variables)
x = 41
""",
            timeout=180,
        ).ok()
        address = k.value("own.address")
        shown = k.execute(f"%taas cluster {address}", timeout=120).ok().stdout
        assert f"connected to the Ray cluster at {address}: 1 node" in shown, shown
        k.execute("y = x + 1").ok()
        driver = k.cluster_driver()
        assert driver is not None
        k.execute("own.shutdown()", timeout=120).ok()
        _, left = psutil.wait_procs([driver], timeout=60)
        assert not [p for p in left if alive(p)], "the driver outlived its cluster"
        assert k.manager.is_alive()
        assert k.execute("print(x, y)").ok().stdout == "41 42\n"
        r = k.execute(one_node + "print('ran')", timeout=60)
        assert r.error is not None and "ran" not in r.stdout
        line = r.error["evalue"]
        assert line.startswith(f"the connection to the Ray cluster at {address} was lost (its driver process "), line
        assert f"%taas cluster {address} connects again" in line and "\n" not in line, line
        k.execute(f"%env RAY_AUTH_TOKEN={local.token}").ok()
        r = k.execute(f"%taas cluster {local.address}", timeout=120).ok()
        assert f"connected to the Ray cluster at {local.address}: 3 nodes" in r.stdout, r.stdout
        k.execute("%taas cluster off", timeout=60).ok()
    finally:
        k.shutdown()


def test_a_producer_node_lost_mid_run_fails_the_cell_naming_it(cluster, registered):
    """A second c1.4 node hosts the producer (the head's is held by someone else) and dies mid-run."""
    local, _ = cluster
    cluster_kernel = registered
    extra = local.add_node("c1.4")
    cluster_kernel.execute(
        own_ray(local.address)
        + f"""
import time
held = ray.util.placement_group([{{'taas:c1.4': 1, 'node:{local.addresses[0]}': 0.001}}])
held.wait(10)
class Slow(Indices):
    def __getitem__(self, i):
        time.sleep(0.05)
        return super().__getitem__(i)
slow = DataLoader(Slow(100000), batch_size=2)
taas.register(slow)
"""
    ).ok()
    try:
        msg_id = cluster_kernel.client.execute(
            HEADER + "for batch in slow:\n    print('built on', int(batch[0, 1]), flush=True)"
        )
        assert first_match(cluster_kernel, msg_id, rf"built on {extra.split('.')[-1]}\b"), (
            "the producer ran on the added node"
        )
        killed = time.monotonic()
        local.remove_node(extra)
        error, seconds = error_of(cluster_kernel, msg_id, since=killed)
        assert error is not None and f"node {extra}" in error["evalue"], error
        assert seconds < 15, seconds
    finally:
        cluster_kernel.execute("ray.util.remove_placement_group(held)\ntaas.unregister(slow)").ok()
    cluster_kernel.execute(HEADER + COLLECT, timeout=240).ok()  # fed from the head again
    # The lost node's run folder (on this machine, as every node is) goes when an agent next starts.
    cluster_kernel.execute("%taas cluster release").ok()
    cluster_kernel.execute(HEADER + "pass", timeout=240).ok()
    assert not leftovers(cluster_kernel)


def test_a_node_lost_mid_session_or_idle_leaves_nothing_of_taas_there_and_the_session_says_so_at_once(
    cluster, cluster_kernel
):
    """Raylets killed by pid, as the out-of-memory killer does: first the one under a session's ranks 0-1 between
    cells, which serves the run's store (``%taas`` tells the session ended, naming the node, at once), then the
    other, whose agent and fork server had nothing to do. Each time nothing of taas stays on the node. Two nodes
    are added back for what follows."""
    local, _ = cluster
    cluster_kernel.execute("%taas cluster release").ok()
    started = cluster_kernel.execute(SESSION + "print('store on', os.environ['MASTER_ADDR'], flush=True)", timeout=240)
    node_0 = re.search(r"store on (\S+)", started.ok().stdout)[1]
    serving = {node: raylet for node, raylet in raylets(local.addresses[1:]).items() if taas_on(raylet)}
    killed: list[str] = []
    try:
        assert len(serving) == 2 and node_0 in serving, (serving, node_0)
        second, raylet = node_0, serving[node_0]
        (first,) = set(serving) - {node_0}
        there = taas_on(raylet)
        assert len(there) >= 5, there  # the agent, its fork server, the session's supervisor, two ranks
        raylet.kill()
        killed.append(second)
        _, left = psutil.wait_procs(there, timeout=15)
        assert not [p for p in left if alive(p)], left
        shown = cluster_kernel.execute("%taas", timeout=60).ok().stdout  # what it tells once the node is gone
        (line,) = [line for line in shown.splitlines() if line.startswith("session:")]
        assert line.startswith(f"session:             ended: node {second} (node ") and "was lost" in line, line
        cluster_kernel.execute("%taas stop", timeout=60).ok()
        raylet = serving[first]
        there = taas_on(raylet)
        assert len(there) >= 2, there  # the warm agent and its fork server, idle
        raylet.kill()
        killed.append(first)
        _, left = psutil.wait_procs(there, timeout=15)
        assert not [p for p in left if alive(p)], left
    finally:
        cluster_kernel.execute("%taas stop", timeout=60).ok()
        for node in killed:
            local.remove_node(node)  # the rest of the node's Ray, as the machine's end would take it
            local.add_node("t.2", cpus=2)
    cluster_kernel.execute(HEADER + "print('on new nodes')", timeout=240).ok()
    assert not leftovers(cluster_kernel)


DDP = """model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
print('store on', os.environ['MASTER_ADDR'], flush=True)
"""
TRAIN = """#pragma taas
print("training", flush=True)
while True:
    model(torch.randn(16, 32)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
"""
REPLICAS = """#pragma taas
total = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))], dtype=torch.float64)
every = [torch.zeros_like(total) for _ in range(dist.get_world_size())]
dist.all_gather(every, total)
print("replicas", len({float(t) for t in every}), "world", dist.get_world_size(), os.environ["WORLD_SIZE"], flush=True)
"""


SYNC = "#pragma taas\nfor parameter in model.parameters():\n    dist.broadcast(parameter.data, 0)\n"


@pytest.mark.parametrize("added", [False, True], ids=["started on both nodes", "grown onto the second"])
def test_a_node_lost_mid_session_the_session_goes_on_with_the_other_nodes_ranks(cluster, cluster_kernel, added):
    """A 2-node session trains a DDP model; the node of ranks 2-3 is lost (its raylet killed by pid) mid-training:
    the cell fails naming it, and the session goes on with ranks 0-1, the same DDP model training on, its
    replicas equal. Nothing of taas stays on the lost node. A node added to the cluster then takes its place:
    `%taas resize 4` grows the session back onto it, the same model training on over four ranks. The same where
    the session started on one node and `%taas resize 4` added the second: the lost node's placement group is let
    go with it, and the resize holds the new node in a new one."""
    local, _ = cluster
    cluster_kernel.execute("%taas cluster release").ok()
    # --cpus 0: loaders an earlier test registered in this kernel are not served (a session that serves them
    # cannot go on without a node's share, and says so)
    alone = SESSION.replace("--keep", "--keep --cpus 0")
    alone = alone.replace("--gpus 4", "--gpus 2") if added else alone
    started = cluster_kernel.execute(alone + "import torch\n" + DDP, timeout=240).ok()
    if added:
        said = cluster_kernel.execute("%taas resize 4", timeout=180).ok().stdout
        assert said.startswith("taas: the session has 4 ranks now: ranks 2-3 joined"), said
    node_0 = re.search(r"store on (\S+)", started.stdout)[1]
    serving = {node: raylet for node, raylet in raylets(local.addresses[1:]).items() if taas_on(raylet)}
    (node_1,) = set(serving) - {node_0}
    there = taas_on(serving[node_1])
    lost = False
    try:
        msg_id = cluster_kernel.client.execute(TRAIN)
        assert first_match(cluster_kernel, msg_id, "training") is not None
        time.sleep(1.0)
        killed = time.monotonic()
        serving[node_1].kill()
        lost = True
        error, seconds = error_of(cluster_kernel, msg_id, since=killed)
        assert error is not None and error["evalue"] == "rank 2 failed: lost with its node", error
        said = "\n".join(error["traceback"])
        assert "the session goes on without ranks 2-3, lost with their node" in said, said
        assert seconds < 30, seconds
        _, left = psutil.wait_procs(there, timeout=15)
        assert not [p for p in left if alive(p)], left
        if "their models may differ now" in said:  # one rank had finished the step's all_reduce as the node went
            cluster_kernel.execute(SYNC, timeout=120).ok()  # as the cell advises
        else:
            assert "ranks 0-1 stopped after optimizer step" in said and "each with the same steps applied" in said
        replicas = cluster_kernel.execute(REPLICAS, timeout=120).ok()
        assert replicas.each_rank().count("replicas 1 world 2 2") == 2, replicas.each_rank()
        shown = cluster_kernel.execute("%taas").ok().stdout
        assert "session:             up: 2 ranks on cpu" in shown, shown
        trained = cluster_kernel.execute(TRAIN, interrupt_after=1.0, counted_from="training", timeout=120)
        assert "ranks 0-1 stopped after optimizer step" in trained.traceback, trained.traceback
        replicas = cluster_kernel.execute(REPLICAS, timeout=120).ok()
        assert replicas.each_rank().count("replicas 1 world 2 2") == 2, replicas.each_rank()
        # A node joins the cluster: Ray gives it the lost node's share of the session's first placement group, and
        # the session grows back onto it. A placement group a resize added went with its lost node: the resize holds
        # the new node in a new one.
        waits = "needs 1 more, the cluster has 1 in all" if added else "node 1 of the session has no node"
        said = cluster_kernel.execute("%taas resize 4", timeout=60).error["evalue"]
        assert said.startswith("%taas resize 4: ") and waits in said, said
        assert len(placement_groups(cluster_kernel)) == 1
        local.remove_node(node_1)  # the rest of the node's Ray, as the machine's end would take it
        local.add_node("t.2", cpus=2)
        lost, deadline = False, time.monotonic() + 60
        while (grown := cluster_kernel.execute("%taas resize 4", timeout=240)).error is not None:
            assert waits in grown.error["evalue"] or "are free now" in grown.error["evalue"], grown.error
            assert time.monotonic() < deadline, "Ray placed no share of the session on the new node"
            time.sleep(2)
        # (the kernel's own connection to Ray, the test's, may print Ray's word that the lost node is dead first)
        said = grown.stdout.splitlines()[-1]
        assert said.startswith("taas: the session has 4 ranks now: ranks 2-3 joined"), grown.stdout
        replicas = cluster_kernel.execute(REPLICAS, timeout=120).ok()
        assert replicas.each_rank().count("replicas 1 world 4 4") == 4, replicas.each_rank()
        trained = cluster_kernel.execute(TRAIN, interrupt_after=1.0, counted_from="training", timeout=120)
        assert "ranks 0-3 stopped after optimizer step" in trained.traceback, trained.traceback
    finally:
        cluster_kernel.execute("%taas stop", timeout=60).ok()
        if lost:
            local.remove_node(node_1)  # the rest of the node's Ray, as the machine's end would take it
            local.add_node("t.2", cpus=2)
    cluster_kernel.execute(HEADER + "print('on a new node')", timeout=240).ok()
    assert not leftovers(cluster_kernel)


def test_a_node_lost_mid_run_fails_the_cell_naming_it_and_leaves_nothing_of_taas_there(cluster, cluster_kernel):
    """Last in this module: it kills a node (and adds another for what follows). Its raylet is killed by pid,
    as the out-of-memory killer does, and Ray ends nothing else on the node: taas's agent leaves with its
    raylet, and its fork server, the run's supervisor and ranks there go with it."""
    local, _ = cluster
    code = "print('on', os.environ['RANK'], os.environ['MASTER_ADDR'], flush=True)\ntime.sleep(600)"  # node 0 dies
    msg_id = cluster_kernel.client.execute(HEADER + code)
    match = first_match(cluster_kernel, msg_id, rf"on \d+ ({re.escape(network(local.addresses))}\d+)")
    assert match is not None
    node = match.group(1)
    raylet = raylet_of(node)
    there = taas_on(raylet)
    assert len(there) >= 5, there  # the agent, its fork server, the run's supervisor, two ranks
    killed = time.monotonic()
    raylet.kill()
    error, seconds = error_of(cluster_kernel, msg_id, since=killed)
    assert error is not None and f"node {node}" in error["evalue"], error
    assert seconds < 15, seconds
    _, left = psutil.wait_procs(there, timeout=max(0.0, killed + 15 - time.monotonic()))
    assert not [p for p in left if alive(p)], left
    local.remove_node(node)  # the rest of the node's Ray, as the machine's end would take it
    local.add_node("t.2", cpus=2)
    cluster_kernel.execute(HEADER + "print('on a new node')", timeout=240).ok()
    assert not leftovers(cluster_kernel)


def test_a_dead_kernel_leaves_no_agent_and_no_rank(cluster):
    local, config = cluster
    others = {p.pid for p in node_agents()}  # the other kernel's
    k = Kernel(
        {"TAAS_CLUSTER": local.address, "TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo", "TAAS_CLUSTER_IDLE": "3"},
        warm_fork_server=False,
    )
    try:
        kernel_state = (
            "(sorted(os.environ.items()), [str(signal.getsignal(s)) for s in signal.valid_signals() "
            "if s not in (signal.SIGKILL, signal.SIGSTOP)])"
        )
        k.execute("import signal").ok()
        before = k.value(kernel_state)
        k.execute(HEADER + "print('up', flush=True)", timeout=240).ok()
        assert k.value(kernel_state) == before, (
            "connecting to Ray left the kernel's environment and handlers as they were"
        )
        idle = [p for p in node_agents() if p.pid not in others]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(alive(p) for p in idle):
            time.sleep(0.5)
        assert idle and not [p for p in idle if alive(p)], "agents unused for TAAS_CLUSTER_IDLE seconds leave"
        k.execute(HEADER + "print('new agents', flush=True)", timeout=240).ok()
        k.client.execute(HEADER + "time.sleep(600)")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(rank_processes()) < 4:  # the cell's ranks are starting
            time.sleep(0.2)
        time.sleep(0.5)  # and have started
        agents = [p for p in node_agents() if p.pid not in others]
        ranks = rank_processes()
        assert len(agents) == 2 and len(ranks) >= 4, ranks
        os.kill(k.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        left = agents + ranks
        while time.monotonic() < deadline and any(alive(p) for p in left):
            time.sleep(0.5)
        assert not [p for p in left if alive(p)]
    finally:
        k.shutdown()  # a failed assertion must not leave the kernel to later tests


def test_nothing_of_the_cluster_talked_beyond_loopback_but_name_lookups(cluster, peers):
    """Last in this module but one: through everything above (tokens, Ray Client, sessions, lost nodes, a
    dead kernel), no process of the cluster or of taas had a peer beyond loopback other than the machine's
    name server. Ray's own services listen on every interface, as a cluster's must (docs/cluster.md says
    so); nobody reached out."""
    assert not peers.beyond_loopback(), peers.beyond_loopback()


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace sees every connect, however short-lived")
def test_starting_a_local_cluster_asks_no_route_beyond_loopback(cluster, tmp_path):
    """Ray finds a process's own address by connecting a UDP socket to 8.8.8.8:53 (no packet is sent: the
    system picks the route), for microseconds: the peers' watch, which samples, cannot see it, strace can.
    Every connect of a local cluster's start, in every process, goes to loopback."""
    local, _ = cluster
    head = network(local.addresses) + "220"  # addresses of its own on this worker's block
    code = (
        "from taas_magic.local_cluster import LocalCluster\n"
        f"LocalCluster({{'c1.4': 1, 't.2': 1}}, first_address={head!r}).shutdown()\n"
    )
    log = tmp_path / "connects.log"
    command = ["strace", "-f", "-qq", "-e", "trace=connect", "-e", "signal=none", "-o", str(log)]
    subprocess.run([*command, sys.executable, "-c", code], check=True, timeout=240, capture_output=True)
    inet = [line for line in log.read_text().splitlines() if "AF_INET" in line]
    assert inet, "strace saw the nodes' connections"
    addresses = {
        m.group(1) for line in inet for m in [re.search(r'inet_(?:addr|pton)\((?:AF_INET6, )?"([^"]+)"', line)] if m
    }
    mapped = {a: ipaddress.ip_address(a) for a in addresses}  # ::ffff:127.0.10.220 is 127.0.10.220
    beyond = sorted(a for a, ip in mapped.items() if not (getattr(ip, "ipv4_mapped", None) or ip).is_loopback)
    assert not beyond, beyond


@pytest.mark.xfail(
    strict=False,
    reason="torch's TCPStore names each connection's peer with getnameinfo: "
    "a reverse lookup of 127.x.y.z, which /etc/hosts lacks, asks the machine's name server",
)
def test_no_name_lookup_left_the_machine(cluster, peers):
    assert not peers.outside, sorted(peers.outside)
