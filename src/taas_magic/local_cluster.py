"""A real Ray cluster on this one machine, to try (and test) cluster runs without a cluster.

Each node is its own raylet on its own loopback address (127.0.0.2, 127.0.0.3, … or from the
``first_address`` given, so that two clusters can run side by side), declares
the configuration it stands for as the Ray resource ``taas:NAME`` and logical GPUs, so ranks run
on CPU over gloo while Ray schedules them exactly as on real machines. Nothing it starts connects
to anything beyond loopback: no dashboard, no usage report (its address points at loopback), no
question to a cloud's metadata server (Ray's usage module asks one which cloud it is on unless the
cluster's launch configuration says; the head's dashboard process is given one that says "local"), and
the variables that say so are set for Ray's processes only, never left in the caller's environment. Its
workers, and so the ranks, run at the machine's usual priority, not at Ray's niceness of 15.
One exception is known: torch's distributed store names the peer of every connection it makes or
accepts with ``getnameinfo``, and 127.x addresses other than 127.0.0.1 are not in ``/etc/hosts``, so those
reverse lookups reach the machine's name server (port 53).

Its nodes require Ray's token authentication (on Ray 2.52 and later) with a token of its own, as a
real cluster should: a notebook connects with ``cluster.variables`` in its environment (Ray's
``RAY_AUTH_MODE`` and ``RAY_AUTH_TOKEN``). The caller's environment never holds them.

    cluster = LocalCluster({"c1.4": 1, "g2.8": 2})   # a CPU head node and two 8-GPU nodes
    %env RAY_AUTH_MODE=token
    %env RAY_AUTH_TOKEN={cluster.token}
    %taas cluster {cluster.address}
    ...
    cluster.shutdown()
"""

from __future__ import annotations

import errno
import glob
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from taas_magic.configurations import load_catalog
from taas_magic.errors import TaasUsageError
from taas_magic.process import containment

QUIET = {
    # Every node here is on loopback: a process of Ray's that does not know its node's address (a node's
    # runtime-environment agent, which wants it for a log prefix) asks the route to 8.8.8.8:53 for one,
    # unless Ray takes this machine for one that runs no multi-node cluster; then it takes 127.0.0.1.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",  # the discard port: a report that goes nowhere
    "RAY_USAGE_STATS_PROMPT_ENABLED": "0",
    # Ray Client's server per client imports Ray afresh; on a busy 2-core machine, or the first time
    # after installing (nothing compiled yet), that takes longer than Ray's 30 s default.
    "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "120",
    # Ray Client's proxy forks a server per client while its gRPC threads are busy; gRPC's own
    # fork handlers then restart threads in the child before it execs, and that child sometimes
    # dies of SIGSEGV at once, leaving the client waiting minutes. The child needs no gRPC.
    "GRPC_ENABLE_FORK_SUPPORT": "false",
}
# Ray starts its workers at niceness 15, below its own daemons: the agents, and the ranks they start, would
# yield the CPU to every other process of the machine (the notebook's kernel, a build), as ranks started
# here or by torchrun do not; on a busy machine a first cluster cell took minutes. Here they run as those do.
USUAL_PRIORITY = {"RAY_worker_niceness": "0"}
FIRST_ADDRESS = "127.0.0.2"  # 127.0.0.1 is what Ray replaces by the machine's address
START_ATTEMPTS = 3  # a new node's agents have a fixed time to start; a machine with every core busy can take longer
START_PAUSE_SECONDS = 5.0  # before the second attempt; twice that before the third
# A file's modification time is the kernel's clock as of its last tick, which lags time.time() by up to a tick: a
# log written just after a start began can look older than the start by milliseconds.
MTIME_LAG_SECONDS = 1.0
START_TURN = "\0taas-local-cluster-node-start"  # a name in Linux's abstract socket namespace: _start_turn
START_TURN_WAIT_SECONDS = 600.0  # a node starts in 10-60 s; a holder that has not finished by then has hung
START_TURN_POLL_SECONDS = 0.2


@contextmanager
def _ray_environment(variables: Mapping[str, str]) -> Iterator[None]:
    """``QUIET``, ``USUAL_PRIORITY`` and ``variables`` in the environment for the block: what Ray's processes
    started meanwhile inherit, and what this process's own calls to the cluster read."""
    from taas_magic.launch.cluster import ray_private

    added = {**QUIET, **USUAL_PRIORITY, **variables}
    saved = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    ray_private.read_authentication_anew()  # Ray reads them once: for this process's own calls to the nodes
    try:
        with ray_private.no_address_probe():  # this process's Ray read the variable as it was imported
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        ray_private.read_authentication_anew()


class LocalCluster:
    """Nodes of the named configurations (``{"g2.8": 2}``), the first one the head.

    With ``client_port``, the head also serves Ray Client there: ``client_address`` is then the
    ``ray://`` address a notebook elsewhere would use (it needs ``pip install 'ray[client]'``).
    ``authenticate``: the nodes require a token of their own (``token``), as Ray's token authentication asks.
    ``first_address``: the head's loopback address, each further node on the next (127.0.0.2, 127.0.0.3, …);
    another cluster on this machine needs addresses of its own.
    """

    def __init__(
        self,
        nodes: Mapping[str, int],
        cpus_per_node: int = 1,
        client_port: int | None = None,
        authenticate: bool = True,
        first_address: str = FIRST_ADDRESS,
    ):
        try:
            from ray.cluster_utils import Cluster
        except ImportError:
            raise TaasUsageError("a local cluster needs Ray: pip install 'taas-magic[ray]'") from None

        catalog = load_catalog()
        shapes = [catalog.get(name) for name, count in nodes.items() for _ in range(count)]
        if not shapes:
            raise ValueError("a cluster needs at least one node")
        self._network, self._first_host = _loopback_block(first_address, len(shapes))
        self.addresses: list[str] = []
        self._nodes: list[Any] = []
        self.token = secrets.token_hex(32) if authenticate else None
        # What a notebook's kernel needs in its environment to connect (Ray's own variables).
        self.variables = {} if self.token is None else {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}
        head = self._node_args(shapes[0], cpus_per_node)
        if client_port is not None:
            head["ray_client_server_port"] = client_port
        self._cluster = Cluster(initialize_head=False)
        dashboard_home = tempfile.mkdtemp(prefix="taas-local-cluster-")
        # Removed at shutdown, or when the cluster is forgotten or the process exits without one.
        self._remove_dashboard_home = weakref.finalize(self, shutil.rmtree, dashboard_home, ignore_errors=True)
        try:
            with _ray_environment(self.variables), _launched_locally(dashboard_home):
                self._nodes.append(_start_node(lambda: self._cluster.add_node(**head)))
            self.addresses.append(self._args_address(0))
            for shape in shapes[1:]:
                self.add_node(shape.name, cpus_per_node)
        except BaseException:
            self.shutdown()  # the nodes that did start: nothing is left running
            raise
        self.address: str = self._cluster.address
        self.client_address = None if client_port is None else f"ray://{self.addresses[0]}:{client_port}"

    def _args_address(self, index: int) -> str:
        return f"{self._network}.{self._first_host + index}"

    def _node_args(self, shape: Any, cpus: int) -> dict[str, Any]:
        return {
            "num_cpus": max(cpus, 1),
            "num_gpus": shape.gpus,
            "include_dashboard": False,
            "node_ip_address": self._args_address(len(self.addresses)),
            "resources": {f"taas:{shape.name}": 1},
        }

    def add_node(self, name: str, cpus: int = 1) -> str:
        """One more node of configuration ``name``; its address."""
        shape = load_catalog().get(name)
        if self._first_host + len(self.addresses) > 255:
            raise ValueError(f"no loopback address is left after {self.addresses[-1]} for another node")
        args = self._node_args(shape, cpus)
        with _ray_environment(self.variables):
            node = _start_node(lambda: self._cluster.add_node(**args))
        self.addresses.append(self._args_address(len(self.addresses)))
        self._nodes.append(node)
        return self.addresses[-1]

    def remove_node(self, address: str) -> None:
        """Kill a node's raylet and everything on it, as a machine that fails would."""
        index = self.addresses.index(address)
        with _ray_environment(self.variables):
            self._cluster.remove_node(self._nodes[index], allow_graceful=False)

    def shutdown(self) -> None:
        try:
            with _ray_environment(self.variables):
                self._cluster.shutdown()
        finally:
            self._remove_dashboard_home()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@contextmanager
def _launched_locally(home: str) -> Iterator[None]:
    """The dashboard process of a head started in the block has ``home`` as its home, where Ray's launch
    configuration (``ray_bootstrap_config.yaml``) names the provider "local": Ray's usage module reads it
    rather than asking cloud metadata servers which cloud this is."""
    from taas_magic.launch.cluster import ray_private

    with open(os.path.join(home, "ray_bootstrap_config.yaml"), "w") as launch:
        launch.write("provider:\n  type: local\n")
    with ray_private.dashboard_environment({"HOME": home}):
        yield


def _loopback_block(first_address: object, nodes: int) -> tuple[str, int]:
    """``("127.0.0", 2)`` for ``"127.0.0.2"``: the address's first three numbers, and its last, from which
    the nodes count up. One line naming the value where it is not a loopback address that leaves room for
    the nodes (127.0.0.1 is the one Ray takes for the machine's own)."""
    network, _, host = first_address.rpartition(".") if isinstance(first_address, str) else ("", "", "")
    numbers = network.split(".")
    allowed = (
        len(numbers) == 3
        and numbers[0] == "127"
        and all(n.isascii() and n.isdigit() and int(n) < 256 for n in numbers)
        and host.isdigit()
        and host.isascii()
        and 2 <= int(host)
        and int(host) + nodes <= 256
    )
    if not allowed:
        raise ValueError(
            f"first_address {first_address!r} is not allowed: use a loopback address 127.x.y.z, z from 2 "
            f"to {256 - nodes}, so that the {nodes} nodes fit on it and the addresses after it"
        )
    return network, int(host)


def _start_node(start: Callable[[], Any]) -> Any:
    """``start()`` a node in this machine's turn (``_start_turn``), again when Ray says it "timed out during
    startup": a new node's raylet waits 15 s for its agents to report their ports and aborts when they have not
    (each agent imports Ray: seconds of CPU, more on a busy machine), and Ray waits 30 s for the raylet to
    register. What a failed start left running (its raylet, its store, the head's GCS: children of this
    process) is ended first, and after the last attempt too; the next attempt waits a little longer each time,
    for the machine to calm down. The last failure says what the raylet said, where it said anything."""
    attempt = 1
    while True:
        before = set(containment.children())
        began = time.time()
        try:
            with _start_turn():
                return start()
        except Exception as e:
            for pid in set(containment.children()) - before:
                containment.end_child(pid)
            if "timed out during startup" not in str(e):
                raise
            if attempt == START_ATTEMPTS:
                complaint = _raylet_complaint(since=began)
                if complaint is None:
                    raise
                raise RuntimeError(f"{e} Its raylet said: {complaint}") from e
        time.sleep(START_PAUSE_SECONDS * attempt)
        attempt += 1


@contextmanager
def _start_turn() -> Iterator[None]:
    """This machine's turn to start a Ray node, held by one process at a time: nodes that start together (two
    clusters, or attempts again in step) share the cores while each raylet gives its agents a fixed time. The
    turn is ``START_TURN`` bound in Linux's abstract socket namespace, which the operating system frees when
    its holder closes it or dies: no file is left, and no holder that died keeps it. Elsewhere, or after
    ``START_TURN_WAIT_SECONDS``, the start goes ahead without it."""
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) if sys.platform.startswith("linux") else None
    deadline = time.monotonic() + START_TURN_WAIT_SECONDS
    try:
        while holder is not None:
            try:
                holder.bind(START_TURN)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    break
                time.sleep(START_TURN_POLL_SECONDS)
        yield
    finally:
        if holder is not None:
            holder.close()


def _raylet_complaint(since: float) -> str | None:
    """What a raylet that started after ``since`` (a ``time.time()``) said as it aborted (Ray's "Check failed"
    line, its cause), or None."""
    from taas_magic.launch.cluster import ray_private

    logs = glob.glob(os.path.join(ray_private.sessions_folder(), "session_2*", "logs", "raylet*.out"))
    for log in sorted(logs, key=os.path.getmtime, reverse=True):
        if os.path.getmtime(log) < since - MTIME_LAG_SECONDS:
            break
        with open(log, errors="replace") as lines:
            for line in lines:
                _, found, cause = line.partition("Check failed: ")
                if found:
                    return cause.strip()
    return None
