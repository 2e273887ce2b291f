"""A Ray cluster's nodes as taas sees them: which configuration each fits, what a run reserves on it, and
whether it is free.

Pure, with no Ray: a node is the plain description the cluster driver reads from Ray
(``connection.Cluster.nodes``), so which nodes a run may take is decided, and tested, apart from the
connection that takes them. A node belongs to a configuration when it declares the Ray resource
``taas:NAME``; a cluster without such labels is matched by GPU count (CPU count for CPU configurations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from taas_magic.configurations import Configuration
from taas_magic.errors import TaasUsageError

LABEL = "taas:"  # prefix of the Ray resource naming a node's configuration


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster, as Ray describes it."""

    node_id: str
    address: str
    resources: Mapping[str, float]  # in total
    available: Mapping[str, float] | None  # not held by anyone right now; None: the cluster did not say in time

    @property
    def labels(self) -> list[str]:
        return sorted(key[len(LABEL) :] for key in self.resources if key.startswith(LABEL))

    def fits(self, configuration: Configuration) -> bool:
        if self.labels:
            return configuration.name in self.labels
        if configuration.gpus:
            return int(self.resources.get("GPU", 0)) == configuration.gpus
        return not self.resources.get("GPU") and self.resources.get("CPU", 0) >= configuration.cpus

    def free_for(self, configuration: Configuration) -> bool:
        return self.available is not None and holds(self.available, bundle_for(configuration, self))


def free_count(nodes: list[Node], configuration: Configuration) -> int | None:
    """How many of ``nodes`` are free for ``configuration``; None when the cluster did not say
    (a count would claim busy nodes that may be free)."""
    if any(node.available is None for node in nodes):
        return None
    return sum(node.free_for(configuration) for node in nodes)


def bundle_for(configuration: Configuration, node: Node | None = None) -> dict[str, float]:
    """What a run reserves on each of its nodes: the whole node, named by its label or its shape."""
    if node is None or node.labels:
        return {LABEL + configuration.name: 1}
    return {"GPU": configuration.gpus} if configuration.gpus else {"CPU": configuration.cpus}


def producer_nodes(
    nodes: list[Node], configuration: Configuration, producer_node: Configuration, producers: int
) -> list[Node]:
    """The cluster's nodes for data producers (none: producers share the run's nodes); one line if
    there are some, but fewer than the run's producers."""
    hosts = [node for node in nodes if node.fits(producer_node) and not node.fits(configuration)]
    if hosts and len(hosts) < producers:
        raise TaasUsageError(
            f"{producers} data producers need a node of {producer_node.name} each, the cluster has {len(hosts)}: "
            "ask for fewer with --cpus (per registered loader), or add such nodes"
        )
    return hosts if producers else []


def holds(available: Mapping[str, float], bundle: Mapping[str, float]) -> bool:
    return all(available.get(key, 0) >= amount for key, amount in bundle.items())
