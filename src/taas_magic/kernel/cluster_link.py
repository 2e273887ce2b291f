"""The kernel's link to a Ray cluster: the address cells run at, the connection made on first use,
`%taas cluster [ADDRESS | off | release]`, and the cluster backend for a cell's run."""

from __future__ import annotations

import os
import sys

from taas_magic.configurations import Catalog, load_catalog
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.kept import Kept
from taas_magic.kernel.spec import LaunchSpec
from taas_magic.launch.cluster import connection
from taas_magic.launch.cluster.backend import ClusterBackend
from taas_magic.launch.cluster.connection import Cluster

PRODUCER_NODE = "c1.4"  # the configuration of nodes for data producers, as in the original service


class ClusterLink:
    """Where cells run: on ``address`` (a Ray cluster) when there is one, else on this machine."""

    def __init__(self, address: str | None) -> None:
        self.address = address  # connected to on first use
        self.cluster: Cluster | None = None  # the connected Ray cluster, once connected

    def connected(self) -> Cluster:
        """The cluster, connecting on first use (to the address of %taas cluster or $TAAS_CLUSTER)."""
        if self.cluster is None:
            assert self.address is not None
            self.cluster = Cluster.connect(self.address, connection.idle_seconds_from(os.environ))
        return self.cluster

    def backend(self, spec: LaunchSpec, catalog: Catalog) -> ClusterBackend:
        """The backend for one run of ``spec`` on the cluster: its nodes, and those for its producers."""
        assert spec.configuration is not None, "the spec refuses a cluster run without one"
        producer_node = catalog.get(PRODUCER_NODE) if PRODUCER_NODE in catalog.names() else None
        return ClusterBackend(
            self.connected(), spec.configuration, spec.nodes, lambda line: print(line, file=sys.stderr), producer_node
        )

    def command(self, words: list[str], kept: Kept) -> None:
        """`%taas cluster [ADDRESS | off | release]`: connect, show the nodes, go back to this machine."""
        if len(words) > 1:
            raise TaasUsageError(f"%taas cluster takes one of ADDRESS, off, release; got {' '.join(words)!r}")
        word = words[0] if words else ""
        if word not in ("", "release"):
            kept.refuse_leaving_the_cluster()
        if word == "off":
            self.disconnect()
            self.address = None
            print("taas: cells run on this machine")
        elif word == "release":
            print(self.release(kept))
        elif word:
            Cluster.check(word)  # before the working connection is let go: a typo keeps it
            previous = self.address
            self.disconnect()
            self.address = word
            try:
                connected = self.connected()
            except BaseException as e:
                self.address = None  # this machine, as the new cluster did not answer
                if previous is not None and previous != word and isinstance(e, TaasUsageError):
                    raise TaasUsageError(
                        f"{e}; the connection to {previous} was closed: cells run on this machine "
                        f"(%taas cluster {previous} connects it again)"
                    ) from None
                raise
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
        released, held = self.cluster.release(keep=serving)
        line = f"taas: {released} warm agent{'s' * (released != 1)} released"
        return line + (f"; {held} kept: {'they serve' if held != 1 else 'it serves'} {what}" if held else "")

    def disconnect(self) -> None:
        """Let the cluster go; its agents and their fork servers end with it."""
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.disconnect()
