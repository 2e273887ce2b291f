"""Where a cluster session's new ranks go as a resize grows it (``launch/cluster/growth.py``): the environment a
rank it did not start with gets, which placement group and bundle hold each node of the session, and the refusal
where the cluster has too few nodes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.configurations import Configuration
from taas_magic.errors import TaasUsageError
from taas_magic.launch.cluster import growth
from taas_magic.launch.cluster.connection import Placement
from taas_magic.launch.cluster.nodes import Node

T2 = Configuration("t.2", gpus=2, cpus=2)


def started_with(nodes: int, per_node: int) -> dict[int, dict[str, str]]:
    """Every rank's environment as a session of ``nodes`` nodes started it (as the kernel makes them)."""
    return {
        rank: {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_node),
            "GROUP_RANK": str(rank // per_node),
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nodes * per_node),
            "MASTER_ADDR": "127.0.0.2",
            "MASTER_PORT": "29500",
            "TAAS_RUN_ID": "run-1",
        }
        for rank in range(nodes * per_node)
    }


@given(started=st.integers(1, 4), per_node=st.integers(1, 4), more=st.integers(0, 4))
def test_a_rank_the_session_did_not_start_with_gets_its_numbers_and_the_sessions_store(started, per_node, more):
    envs = started_with(started, per_node)
    for rank in range((started + more) * per_node):
        env = growth.environment(envs, rank, per_node)
        if rank in envs:
            assert env == envs[rank]
            continue
        assert (env["RANK"], env["ROLE_RANK"]) == (str(rank), str(rank))
        assert (env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank % per_node), str(rank // per_node))
        assert {name: env[name] for name in ("MASTER_ADDR", "MASTER_PORT", "TAAS_RUN_ID")} == {
            "MASTER_ADDR": "127.0.0.2",
            "MASTER_PORT": "29500",
            "TAAS_RUN_ID": "run-1",
        }, "it joins the session's store"
    assert envs == started_with(started, per_node), "the session's environments are not changed"


def placement(name: str, bundles: int, hosts: int = 0) -> Placement:
    return Placement(name, [], [{"taas:t.2": 1}] * bundles, hosts)


@given(first=st.integers(1, 4), hosts=st.integers(0, 2), added=st.lists(st.integers(1, 3), max_size=3))
def test_each_node_of_a_session_is_a_bundle_of_one_of_its_placement_groups_in_order(first, hosts, added):
    held = [placement("first", first + hosts, hosts)] + [placement(f"added {n}", size) for n, size in enumerate(added)]
    expected = [("first", bundle) for bundle in range(first)]
    expected += [(f"added {n}", bundle) for n, size in enumerate(added) for bundle in range(size)]
    assert [growth._bundle(held, index) for index in range(len(expected))] == expected
    with pytest.raises(IndexError):
        growth._bundle(held, len(expected))


class NodesOf:
    """A cluster that has ``count`` nodes of t.2 and a CPU node, and places nothing."""

    def __init__(self, count: int):
        self.count = count
        self.placed: list[int] = []

    def nodes(self) -> list[Node]:
        t2 = [Node(f"n{i}", f"127.0.0.{i + 2}", {"taas:t.2": 1, "GPU": 2}, None) for i in range(self.count)]
        return [Node("head", "127.0.0.1", {"taas:c1.4": 1, "CPU": 4}, None), *t2]

    def place(self, configuration: Configuration, count: int) -> Placement:
        self.placed.append(count)
        return placement("added", count)


@given(have=st.integers(0, 5), held=st.integers(1, 4), more=st.integers(1, 4))
def test_more_nodes_than_the_cluster_has_are_refused_in_one_line_before_ray_is_asked(have, held, more):
    cluster = NodesOf(have)
    if held + more > have:
        with pytest.raises(TaasUsageError) as caught:
            growth.place_more(cluster, T2, held, more)  # type: ignore[arg-type]
        said = str(caught.value)
        assert f"needs {more} more, the cluster has {have} in all" in said and "\n" not in said, said
        assert cluster.placed == []
    else:
        assert len(growth.place_more(cluster, T2, held, more).bundles) == more  # type: ignore[arg-type]
        assert cluster.placed == [more]
