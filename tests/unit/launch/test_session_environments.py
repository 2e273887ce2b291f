"""The environment a session's supervisor keeps for each of its ranks, to start a new process in place of one that
dies: after a resize on this machine it names every rank of the new size; on a cluster's node, whose session only
ever loses nodes, it keeps that node's own ranks with the new sizes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from taas_magic.launch.supervisor.ranks import ForkedRanks
from taas_magic.wire.rank_control import SessionCell


def environments(ranks: range, per_node: int, world: int) -> dict[int, dict[str, str]]:
    nodes = world // per_node
    return {
        rank: {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % per_node),
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_WORLD_SIZE": str(nodes),
            "GROUP_RANK": str(rank // per_node),
            "MASTER_PORT": "29500",
        }
        for rank in ranks
    }


@given(size=st.integers(1, 8), world=st.integers(1, 8), resizes=st.integers(1, 3))
def test_on_this_machine_a_resize_keeps_an_environment_for_every_rank_of_the_new_size(
    size: int, world: int, resizes: int
) -> None:
    group = ForkedRanks()
    group.envs = environments(range(size), size, size)
    try:
        for step in range(resizes):
            group._resize(SessionCell.resize(step + 1, world, len(group.envs)))
            assert sorted(group.envs) == list(range(world))
            for rank, env in group.envs.items():
                assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), str(world))
                sizes = (env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"], env["MASTER_PORT"])
                assert sizes == (str(world), "1", "29500")
            world = max(1, world - 1)
    finally:
        group.close()


@given(per_node=st.integers(1, 4), nodes=st.integers(2, 4), node=st.data(), lost=st.data())
def test_on_a_clusters_node_a_lost_node_keeps_its_own_ranks_with_the_new_sizes(
    per_node: int, nodes: int, node: st.DataObject, lost: st.DataObject
) -> None:
    """Ranks keep their numbers and their place on their node; the session's sizes are those of the nodes left."""
    index = node.draw(st.integers(0, nodes - 2), label="this node")
    left = lost.draw(st.integers(index + 1, nodes - 1), label="nodes left")
    world = nodes * per_node
    mine = range(index * per_node, (index + 1) * per_node)
    group = ForkedRanks()
    group.envs = environments(mine, per_node, world)
    try:
        group._resize(SessionCell.resize(1, left * per_node, world, nodes=left))
        assert sorted(group.envs) == list(mine)
        for rank, env in group.envs.items():
            assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank), str(rank % per_node), str(index))
            sizes = (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_WORLD_SIZE"])
            assert sizes == (str(left * per_node), str(per_node), str(left))
    finally:
        group.close()
