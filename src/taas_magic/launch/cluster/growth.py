"""Where a cluster session's new ranks go as ``%taas resize`` grows it: onto the nodes its placement groups hold.

A session starts with one placement group, one whole node per bundle (``connection.Cluster.place``). A resize that
shrinks it keeps its emptied nodes held; one that grows it takes those first, then asks Ray for the nodes still
missing in a placement group of their own (Ray cannot add bundles to a group that exists). A node of the session is
a bundle of one of its groups, numbered as its ranks' ``GROUP_RANK``: the first group's rank nodes, then each added
group's nodes in order. Ray moves a lost node's bundle onto a node that joins the cluster later, so which node a
bundle holds is asked of Ray each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from taas_magic.configurations import Configuration
from taas_magic.errors import TaasUsageError
from taas_magic.launch.cluster.agent import NodePayload
from taas_magic.launch.cluster.connection import Cluster, Placement
from taas_magic.launch.cluster.nodes import LABEL, Node


@dataclass(frozen=True)
class Joiners:
    """What a session's new ranks start with (``ClusterRanks.grow``): its run and versions, its task and folder
    without its names, and the configuration of the nodes it adds."""

    run_id: str
    versions: tuple[str, str, str]
    payload: NodePayload
    configuration: Configuration


def node_for(cluster: Cluster, placements: Sequence[Placement], index: int, gone: Collection[str]) -> Node:
    """The node that holds node ``index`` of the session now; a one-line refusal while none does (one was lost,
    and no node has joined the cluster in its place yet). ``gone``: the ids of nodes the session lost, which Ray
    may still count alive a while."""
    from ray.util.placement_group import placement_group_table

    group, bundle = _bundle(placements, index)
    node_id = placement_group_table(group)["bundles_to_node_id"].get(bundle)
    alive = {node.node_id: node for node in cluster.nodes() if node.node_id not in gone}
    if node_id not in alive:
        raise TaasUsageError(
            f"node {index} of the session has no node of the cluster now (one was lost): Ray gives it the next "
            "node of its configuration that joins the cluster; %taas resize again once one has"
        )
    return alive[node_id]


def _bundle(placements: Sequence[Placement], index: int) -> tuple[Any, int]:
    """The placement group and bundle of the session's node ``index``."""
    first = placements[0]
    offset = len(first.bundles) - first.hosts
    if index < offset:
        return first.group, index
    for added in placements[1:]:
        if index < offset + len(added.bundles):
            return added.group, index - offset
        offset += len(added.bundles)
    raise IndexError(f"the session has no node {index}")


def place_more(
    cluster: Cluster, configuration: Configuration, held: int, count: int, gone: Collection[str] = ()
) -> Placement:
    """``count`` whole nodes of ``configuration`` more, in a placement group of their own, for a session that holds
    ``held``; refused in one line, nothing held, where the cluster has too few nodes of it (``gone``: the nodes the
    session lost, which Ray may count alive a while), or too few free."""
    have = sum(node.fits(configuration) and node.node_id not in gone for node in cluster.nodes())
    if held + count > have:
        raise TaasUsageError(
            f"the session holds {held} node{'s' * (held != 1)} of {configuration.name} and needs {count} more, the "
            f"cluster has {have} in all: add nodes that declare the Ray resource {LABEL}{configuration.name}"
        )
    return cluster.place(configuration, count)


def environment(envs: Mapping[int, Mapping[str, str]], rank: int, per_node: int) -> dict[str, str]:
    """Rank ``rank``'s environment: as the session started it, or for a rank it did not start with, its first
    rank's with this rank's numbers (``per_node`` ranks on each node)."""
    if rank in envs:
        return dict(envs[rank])
    numbers = {"RANK": rank, "LOCAL_RANK": rank % per_node, "GROUP_RANK": rank // per_node, "ROLE_RANK": rank}
    return {**envs[min(envs)], **{name: str(value) for name, value in numbers.items()}}
