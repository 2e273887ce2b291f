"""Delivery across nodes, piece by piece: who hosts which producer, counters merged by row owner,
elements relayed unchanged, the kernel's progress line. The whole path on a real cluster is in
test_cluster.py."""

from __future__ import annotations

import torch

from taas_magic.delivery.cluster import NodeDelivery, RunProgress, shares
from taas_magic.delivery.counters import Counters
from taas_magic.wire.events import Producer
from taas_magic.delivery.service import LoaderPlan
from taas_magic.delivery.transport import channel_pair, put, receive, send, take_waiting


def plan(name: str, producers: int) -> LoaderPlan:
    return LoaderPlan(name, producers, None, None, False, 0)


def test_with_cpu_nodes_every_producer_has_one_to_itself_and_rank_nodes_pull_from_them():
    loaders = (plan("a", 2), plan("b", 1))
    found = shares("run", loaders, [(0, 1), (2, 3)], hosts=3, agents=["n0", "n1", "h0", "h1", "h2"],
                   addresses=["a0", "a1", "a2", "a3", "a4"])
    assert [s.ranks for s in found] == [(0, 1), (2, 3), (), (), ()]
    assert [s.hosted for s in found] == [((), ()), ((), ()), ((0,), ()), ((1,), ()), ((), (0,))]
    assert found[0].sources == found[1].sources == ((("h0", "a2"), ("h1", "a3")), (("h2", "a4"),))
    assert all(s.sources == () for s in found[2:]), "hosts alone pull nothing"
    assert all(s.world == 4 and s.active() for s in found)


def test_without_cpu_nodes_producers_take_turns_on_the_run_s_nodes():
    found = shares("run", (plan("a", 3),), [(0, 1), (2, 3)], hosts=0, agents=["n0", "n1"], addresses=["a0", "a1"])
    assert [s.hosted for s in found] == [((0, 2),), ((1,),)]
    assert found[0].sources == found[1].sources == ((("n0", "a0"), ("n1", "a1")),)


def test_counters_merge_only_the_rows_another_copy_owns():
    host, rank_node, kernel = Counters(2, 3), Counters(2, 3), Counters(2, 3)
    host.produced[1] = 5
    host.count_sent(1, 2)
    host.position[2] = 99  # a stale copy of a row the rank node owns
    rank_node.position[2], rank_node.taken[2], rank_node.done[2] = 4, 3, 1
    host.take_rows(rank_node.snapshot(), ranks=[2])
    assert (host.position[2], host.taken[2], host.done[2]) == (4, 3, 1)
    kernel.take_rows(host.snapshot(), producers=[1])
    kernel.take_rows(rank_node.snapshot(), ranks=[2])
    stats = kernel.stats("a")
    assert (stats.produced, stats.taken, stats.done, stats.skipped) == (5, [0, 0, 3], [0, 0, 1], [0, 0, 1])
    assert kernel.produced[0] == 0, "producer 0's row belongs to another copy"


def test_a_counters_memory_file_is_shared_by_whoever_maps_it():
    from taas_magic.wire import memfile

    fd = memfile.new_file("counters", Counters.size(1, 2))
    try:
        one, two = Counters(1, 2, fd), Counters(1, 2, fd)
        one.taken[1] = 7
        assert two.taken[1] == 7
    finally:
        import os

        os.close(fd)


def test_an_element_relayed_as_bytes_arrives_as_the_producer_sent_it():
    producers_end, host_end = channel_pair()
    feeder_end, rank_end = channel_pair()
    element = (torch.arange(12, dtype=torch.float32).reshape(3, 4), {"label": torch.tensor([1, 2, 3])})
    send(producers_end, 2, 7, element)
    header, data = take_waiting(host_end)
    assert take_waiting(host_end) is None, "nothing else waits"
    put(feeder_end, header, data)
    pass_number, index, received = receive(rank_end)
    assert (pass_number, index) == (2, 7)
    assert torch.equal(received[0], element[0]) and torch.equal(received[1]["label"], element[1]["label"])
    producers_end.close()
    assert take_waiting(host_end) == (b"", b""), "every sender closed the channel"
    for end in (host_end, feeder_end, rank_end):
        end.close()


def test_a_pull_returns_what_waits_for_the_asking_node_s_ranks_and_says_when_producers_are_done():
    share = shares("run", (plan("a", 1),), [(0, 1)], hosts=1, agents=["n0", "h0"], addresses=["a0", "a1"])[1]
    host = NodeDelivery(share)
    try:
        assert len(host.loaders[0].inbox) == 2 and host.loaders[0].outbox == {}
        producers_ends = host.loaders[0].handed
        send(producers_ends[1], 0, 1, torch.tensor([1]))
        rank_node = Counters(1, 2)
        rank_node.position[1] = 3
        elements, ended = host.pull(0, (0, 1), rank_node.snapshot())
        assert [(rank, len(data) > 0) for rank, _, data in elements] == [(1, True)] and not ended
        assert host.loaders[0].counters.position[1] == 3, "the rank node's rows came with its pull"
        host.handed_over()  # no producer holds the channels: they are over
        assert host.pull(0, (0, 1), rank_node.snapshot()) == ([], True)
    finally:
        host.close()


def test_the_kernel_s_progress_line_changes_only_when_a_merged_count_does():
    found = shares("run", (plan("a", 1),), [(0,), (1,)], hosts=1, agents=["n0", "n1", "h0"], addresses=["a0", "a1", "a2"])
    progress = RunProgress(found)
    host, node0 = Counters(1, 2), Counters(1, 2)
    host.produced[0] = 4
    host.count_sent(0, 0)
    host.count_sent(0, 1)
    [(key, line)] = progress.take(2, [host.snapshot()])
    assert key == Producer(0, 0) and line.produced == 4 and line.buffered == 2
    assert progress.take(2, [host.snapshot()]) == [], "nothing changed"
    node0.position[0] = node0.taken[0] = 1
    [(_, line)] = progress.take(0, [node0.snapshot()])
    assert line.taken == [1, 0] and line.buffered == 1
