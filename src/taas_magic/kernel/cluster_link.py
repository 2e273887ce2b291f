"""The kernel's link to a Ray cluster: the address cells run at, the connection made on first use (and
made again after it was lost), `%taas cluster [ADDRESS | off | release]`, and the cluster backend for a
cell's run."""

from __future__ import annotations

import os

from taas_magic.configurations import Catalog, load_catalog
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header.spec import LaunchSpec
from taas_magic.kernel.sessions.kept import Kept
from taas_magic.kernel.view import streams
from taas_magic.launch.cluster import connection
from taas_magic.launch.cluster.backend import ClusterBackend
from taas_magic.launch.cluster.driver_link import ConnectedCluster, lost_message

PRODUCER_NODE = "c1.4"  # the configuration of nodes for data producers, as in the original service


class ClusterLink:
    """Where cells run: on ``address`` (a Ray cluster) when there is one, else on this machine."""

    def __init__(self, address: str | None) -> None:
        self.address = address  # connected to on first use
        self.cluster: ConnectedCluster | None = None  # the connected Ray cluster, once connected

    def connected(self) -> ConnectedCluster:
        """The cluster, connecting on first use (to the address of %taas cluster or $TAAS_CLUSTER). A
        connection that was lost is said once, in one line; the next use connects again."""
        if self.cluster is not None:
            lost = self.cluster.lost()
            if lost is not None:
                cluster, self.cluster = self.cluster, None
                cluster.disconnect()
                raise TaasUsageError(lost_message(cluster.address, lost))
        if self.cluster is None:
            assert self.address is not None
            self.cluster = ConnectedCluster.connect(self.address, connection.idle_seconds_from(os.environ), _to_stderr)
        return self.cluster

    def describe(self) -> str:
        """The cluster line of `%taas`: where cells run, and a connection that was lost since."""
        if self.address is None:
            return "none (%taas cluster ADDRESS connects one)"
        lost = self.cluster.lost() if self.cluster is not None else None
        if lost is not None:
            return f"{self.address} (the connection was lost: {lost}; the next cluster cell says so and connects again)"
        return f"{self.address} (cells run there; --on local runs one here)"

    def backend(self, spec: LaunchSpec, catalog: Catalog) -> ClusterBackend:
        """The backend for one run of ``spec`` on the cluster: its nodes, and those for its producers."""
        assert spec.configuration is not None, "the spec refuses a cluster run without one"
        producer_node = catalog.get(PRODUCER_NODE) if PRODUCER_NODE in catalog.names() else None
        return ClusterBackend(
            self.connected(), spec.configuration, spec.nodes, _to_stderr, producer_node, keep=spec.keep
        )

    def command(self, words: list[str], kept: Kept) -> None:
        """`%taas cluster [ADDRESS | off | release]`: connect, show the nodes, go back to this machine."""
        if len(words) > 1:
            raise TaasUsageError(f"%taas cluster takes one of ADDRESS, off, release; got {' '.join(words)!r}")
        word = words[0] if words else ""
        if word == "release":
            kept.refuse_while_on_the_cluster_in_background("release the warm agents")
        elif word:
            kept.refuse_leaving_the_cluster()
        if word == "off":
            self.disconnect()
            self.address = None
            print("taas: cells run on this machine")
        elif word == "release":
            print(self.release(kept))
        elif word:
            # The new connection first: one that fails (a typo, a cluster that refuses) keeps the working one.
            connected = ConnectedCluster.connect(word, connection.idle_seconds_from(os.environ), _to_stderr)
            self.disconnect()
            self.address, self.cluster = word, connected
            print(connected.describe(load_catalog()))
        elif self.address is None:
            print("taas: not connected to a cluster: %taas cluster ADDRESS (auto, HOST:PORT or ray://HOST:PORT)")
        else:
            print(self.connected().describe(load_catalog()))

    def release(self, kept: Kept) -> str:
        """`%taas cluster release`: end the idle agents; those serving a session or a paused rank are not idle."""
        if self.cluster is None:
            return "taas: 0 warm agents released"
        serving, what = kept.cluster_nodes_in_use()
        released, held = self.cluster.release(frozenset(serving))
        line = f"taas: {released} warm agent{'s' * (released != 1)} released"
        return line + (f"; {held} kept: {'they serve' if held != 1 else 'it serves'} {what}" if held else "")

    def disconnect(self) -> None:
        """Let the cluster go; its agents and their fork servers end with it."""
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.disconnect()


def _to_stderr(line: str) -> None:
    """A line of taas's for the running cell: the notebook's folder going to the cluster, rank 0's files back (a
    run in the background's, in its own cell)."""
    streams.say(line)
