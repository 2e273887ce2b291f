"""The end-to-end cluster tier: the real Ray cluster its tests share, and the watch on what its
processes talk to. One cluster serves modules that run one after another in a test process: starting
one takes about 20 s on this machine, and a module's fixtures are handed to the next module when it uses
them too (``_handed_on``), then stopped after the last. Each worker of a parallel run has a cluster of
its own, on loopback addresses of its own (127.0.10.x for the first, 127.0.11.x for the next, ...).

A CPU head node (c1.4) and two t.2 nodes, each raylet on its own loopback address, logical GPUs.
"""

from __future__ import annotations

import glob
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil
import pytest
from support import sockets
from support.cluster import DATA
from support.kernel import Kernel
from support.tiers import marks_for

CONFIG = "configurations:\n  t.2: {cpus: 2, gpus: 2, memory_gb: 4}\n"

# A cluster cell's first run starts the agents and their fork servers on every node: minutes on a busy machine.
pytest_itemcollected = marks_for(__file__, "e2e", "cluster", "kernel", pytest.mark.timeout(300))

_next: pytest.Item | None = None  # the test that runs after the one being torn down
_kept: dict[str, object] = {}  # what a module hands on to the next, by fixture name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _next
    _next = nextitem  # before the fixtures of item's module are finalised
    yield


def _handed_on(name: str) -> bool:
    """Whether the next test, in another module, uses fixture ``name`` (itself or through another)."""
    return _next is not None and name in getattr(_next, "fixturenames", ())


# Between two looks at the machine's sockets. Each look dumps the kernel's TCP tables twice (IPv4, IPv6), about
# 2.4 ms of CPU each whatever they hold; 20 looks a second cost each worker about 50 s of CPU in the tier's 7
# minutes. A connection this machine closes stays in the table for a minute (TIME_WAIT) and one that fails
# for lack of a route leaves no socket at all (test_cluster_nodes.py's strace sees those): five looks a
# second miss only a connection the far side closed within 0.2 s.
LOOK_SECONDS = 0.2


class PeerWatch:
    """Every connection with a peer beyond loopback that any process started from this one (the
    cluster's raylets and workers, agents, fork servers, ranks, kernels) has, sampled every LOOK_SECONDS
    from before the cluster starts: a usage report or a cloud metadata probe would show up. A TCP
    connection this machine opened and closed between two looks stays in the kernel's table for a
    minute (TIME_WAIT), without its process: it counts too, as process 0."""

    def __init__(self) -> None:
        self.outside: set[tuple[int, str, str]] = set()
        self._ended_before = {self._ended(s) for s in sockets.outward(sockets.sockets()) if not s.inode}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    @staticmethod
    def _ended(s: sockets.Socket) -> tuple[int, str, str]:
        return (0, f"closed before a look found its process (port {s.local_port})", s.peer_text)

    def _watch(self) -> None:
        me = psutil.Process()
        while not self.stopped.wait(LOOK_SECONDS):
            found = sockets.outward(sockets.sockets())
            self.outside |= {self._ended(s) for s in found if not s.inode} - self._ended_before
            live = {s.inode: s for s in found if s.inode}
            if live:
                ours = {p.pid: p for p in me.children(recursive=True)}
                for inode, pid in sockets.holders(live, ours).items():
                    self.outside.add((pid, _command(ours[pid]), live[inode].peer_text))

    def beyond_loopback(self) -> list[tuple[int, str, str]]:
        """The peers beyond loopback seen so far but the machine's name server (port 53): torch's store
        names each connection's peer with ``getnameinfo``, and 127.x addresses but 127.0.0.1 are not in
        /etc/hosts."""
        time.sleep(0.3)  # a few more samples
        assert self.thread.is_alive()
        return sorted(peer for peer in self.outside if not peer[2].endswith(":53"))

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:160]
    except psutil.Error:
        return "?"


@pytest.fixture(scope="module")
def peers() -> Iterator[PeerWatch]:
    watch = _kept.pop("peers", None) or PeerWatch()
    assert isinstance(watch, PeerWatch)
    yield watch
    if _handed_on("peers"):
        _kept["peers"] = watch
    else:
        watch.stop()


@pytest.fixture(scope="module")
def shared_modules(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A folder of Python modules that the nodes and the kernel import from (on $PYTHONPATH), as
    code on a shared file system would be: the notebook's own files do not travel to the nodes."""
    if "shared_modules" in _kept:
        folder, saved = _kept.pop("shared_modules")  # type: ignore[misc]
    else:
        folder, saved = tmp_path_factory.mktemp("shared_modules"), os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), saved]))
    yield folder
    if _handed_on("shared_modules"):
        _kept["shared_modules"] = (folder, saved)
    elif saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, peers: PeerWatch, shared_modules: object) -> Iterator[tuple]:
    """``(LocalCluster, path of its configurations file)``, the file in $TAAS_CONFIG and the cluster's token in
    Ray's $RAY_AUTH_MODE and $RAY_AUTH_TOKEN, for the kernels the tests start: the cluster requires it."""
    if "cluster" in _kept:
        local, config, saved = _kept.pop("cluster")  # type: ignore[misc]
    else:
        from taas_magic.local_cluster import LocalCluster

        config = tmp_path_factory.mktemp("cluster") / "configurations.yaml"
        config.write_text(CONFIG)
        saved = {name: os.environ.get(name) for name in ("TAAS_CONFIG", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        os.environ["TAAS_CONFIG"] = str(config)
        head = f"127.0.{10 + _worker_number()}.2"
        local = LocalCluster({"c1.4": 1, "t.2": 2}, client_port=_free_port(head), first_address=head)
        os.environ.update(local.variables)  # the kernels' (Ray's token authentication)
    try:
        yield local, str(config)
    finally:
        if _handed_on("cluster"):
            _kept["cluster"] = (local, config, saved)
        else:
            local.shutdown()
            left = glob.glob(os.path.join(tempfile.gettempdir(), "taas-local-cluster-*"))
            assert not left, f"the cluster's dashboard home outlived it: {left}"
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _worker_number() -> int:
    """0 for xdist's worker gw0 and for a run without xdist, 1 for gw1, ..."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


def _free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def cluster_kernel(cluster, tmp_path_factory):
    """A module's kernel connected to the cluster through $TAAS_CLUSTER, in a notebook folder of its own."""
    local, config = cluster
    folder = tmp_path_factory.mktemp("notebook")
    k = Kernel(
        {"TAAS_CLUSTER": local.address, "TAAS_CONFIG": config, "GLOO_SOCKET_IFNAME": "lo"}, warm_fork_server=False
    )
    k.execute(f"os.chdir({str(folder)!r})").ok()
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def registered(cluster_kernel):
    """The module's kernel with ``support.cluster.DATA``'s loader registered."""
    cluster_kernel.execute(DATA).ok()
    return cluster_kernel
