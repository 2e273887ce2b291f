"""Delivery across nodes, piece by piece: who hosts which producer, counters merged by row owner,
elements relayed unchanged, the kernel's progress line. The whole path on a real cluster is in
test_cluster.py."""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.descriptors import open_descriptors, opened_since

from taas_magic.delivery import relay
from taas_magic.delivery.cluster import NodeDelivery
from taas_magic.delivery.cluster_share import RunProgress, shares
from taas_magic.delivery.counters import Counters
from taas_magic.delivery.service import LoaderPlan
from taas_magic.delivery.transport import channel_pair, put_file, receive, send, take_waiting_file
from taas_magic.wire.events import Producer


def plan(name: str, producers: int) -> LoaderPlan:
    return LoaderPlan(name, producers, None, None, False, 0)


def test_with_cpu_nodes_every_producer_has_one_to_itself_and_rank_nodes_pull_from_them():
    loaders = (plan("a", 2), plan("b", 1))
    found = shares(
        "run",
        loaders,
        [(0, 1), (2, 3)],
        hosts=3,
        agents=["n0", "n1", "h0", "h1", "h2"],
        addresses=["a0", "a1", "a2", "a3", "a4"],
    )
    assert [s.ranks for s in found] == [(0, 1), (2, 3), (), (), ()]
    assert [s.hosted for s in found] == [((), ()), ((), ()), ((0,), ()), ((1,), ()), ((), (0,))]
    assert found[0].sources == found[1].sources == ((("h0", "a2"), ("h1", "a3")), (("h2", "a4"),))
    assert all(s.sources == () for s in found[2:]), "hosts alone pull nothing"
    assert all(s.world == 4 and s.active() for s in found)


def test_without_cpu_nodes_producers_take_turns_on_the_run_s_nodes():
    found = shares("run", (plan("a", 3),), [(0, 1), (2, 3)], hosts=0, agents=["n0", "n1"], addresses=["a0", "a1"])
    assert [s.hosted for s in found] == [((0, 2),), ((1,),)]
    assert found[0].sources == found[1].sources == ((("n0", "a0"), ("n1", "a1")),)


def test_a_sessions_later_loaders_take_turns_on_its_cpu_nodes_or_on_the_nodes_it_still_has_ranks_on():
    """Loaders a session begins to serve after it started: more producers than the session's CPU nodes take turns on
    them; without CPU nodes, on the nodes that still have ranks (a node lost, or emptied by a resize, has none). Each
    share is numbered from its first loader and named apart from the run's first, for the streams between nodes."""
    on_hosts = shares("run/2", (plan("c", 3),), [(0, 1), (2, 3)], 2, ["n0", "n1", "h0", "h1"], ["a0"] * 4, first=2)
    assert [s.hosted for s in on_hosts] == [((),), ((),), ((0, 2),), ((1,),)]
    assert all(s.first == 2 and s.run_id == "run/2" for s in on_hosts)
    without = shares("run/1", (plan("c", 3),), [(0, 1), (), (4, 5)], 0, ["n0", "n1", "n2"], ["a0"] * 3, first=1)
    assert [s.hosted for s in without] == [((0, 2),), ((),), ((1,),)], "none on the node without ranks"
    assert not without[1].active() and without[0].sources == ((("n0", "a0"), ("n2", "a0")),)


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


def test_an_element_relayed_as_its_file_arrives_as_the_producer_sent_it():
    producers_end, host_end = channel_pair()
    feeder_end, rank_end = channel_pair()
    element = (torch.arange(12, dtype=torch.float32).reshape(3, 4), {"label": torch.tensor([1, 2, 3])})
    send(producers_end, 2, 7, element)
    header, fd = take_waiting_file(host_end)
    assert take_waiting_file(host_end) is None, "nothing else waits"
    put_file(feeder_end, header, fd)
    os.close(fd)
    pass_number, index, received = receive(rank_end)
    assert (pass_number, index) == (2, 7)
    assert torch.equal(received[0], element[0]) and torch.equal(received[1]["label"], element[1]["label"])
    producers_end.close()
    assert take_waiting_file(host_end) == (b"", -1), "every sender closed the channel"
    for end in (host_end, feeder_end, rank_end):
        end.close()


class _Agent:
    """What a rank node's feeder asks of a host's agent through Ray, without Ray."""

    def __init__(self, host: NodeDelivery):
        self.relay_address = SimpleNamespace(remote=lambda run_id: host.relay_address())


def _nodes() -> tuple[NodeDelivery, NodeDelivery]:
    found = shares("run", (plan("a", 1),), [(0, 1)], hosts=1, agents=["n0", "h0"], addresses=["127.0.0.2", "127.0.0.3"])
    host = NodeDelivery(found[1])
    rank_node = NodeDelivery(dataclasses.replace(found[0], sources=(((_Agent(host), "127.0.0.3"),),)))
    return host, rank_node


def test_a_host_streams_each_element_once_to_its_rank_and_leaves_nothing_open():
    gc.collect()  # what earlier tests left for the collector is closed before, not during, the count
    descriptors = open_descriptors()
    host, rank_node = _nodes()
    try:
        assert host.relay_address() == ("127.0.0.3", host.listener.port), "the host listens on its node's address"
        assert rank_node.relay_address() == ("", 0) and rank_node.listener is None, (
            "a node of ranks alone listens nowhere"
        )
        producers_ends = host.loaders[0].handed
        big = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB: more than one read of the stream
        for index in range(3):
            send(producers_ends[index % 2], 0, index, (big + index, index))
        rank_ends = rank_node.loaders[0].handed
        host.handed_over()  # no producer holds the channels now: they end after what waits
        rank_node.start_feeding(lambda where, timeout: where)
        got = {0: [], 1: []}
        for rank in (0, 1):
            rank_end = rank_ends[rank]
            rank_end.settimeout(20)
            while True:
                try:
                    _, index, (tensor, same) = receive(rank_end)
                except EOFError:
                    break
                assert index == same and torch.equal(tensor, big + index)
                got[rank].append(index)
        assert got == {0: [0, 2], 1: [1]}, "each element once, to its rank, in order"
        assert rank_node.failure is None
    finally:
        rank_node.close()
        host.close()
    assert not [t for t in rank_node.threads + host.listener.threads if t.is_alive()], "no thread outlives the run"
    del host, rank_node, tensor  # the counters' mappings hold a descriptor each while they exist
    gc.collect()
    assert opened_since(descriptors) == set(), "no socket, pipe or memory file outlives the run"


def test_the_hosts_producers_see_the_rank_node_s_counters_and_its_end():
    host, rank_node = _nodes()
    try:
        # the host keeps the producers' ends: its channels stay open, as while producers run
        rank_node.loaders[0].counters.position[1] = 3
        rank_node.start_feeding(lambda where, timeout: where)
        deadline = time.monotonic() + 10
        while host.loaders[0].counters.position[1] != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.loaders[0].counters.position[1] == 3, "the rank node's rows reached the host"
        for rank in (0, 1):
            rank_node.loaders[0].counters.done[rank] = 1
        rank_node.threads[0].join(10)
        assert not rank_node.threads[0].is_alive(), "a node whose ranks are done stops reading"
        assert host.loaders[0].counters.done.tolist() == [1, 1], "after telling the host so"
    finally:
        rank_node.close()
        host.close()


def test_a_stream_is_refused_to_whoever_lacks_the_run_s_secret():
    host, rank_node = _nodes()
    try:
        address, port = host.relay_address()
        with pytest.raises(relay.RelayBroken, match="the stream ended after 0 of 32 bytes"):  # hung up on
            relay.connect(address, port, b"x" * 32, 0, (0, 1))
        stranger = socket.create_connection((address, port))
        stranger.sendall(b"\0" * 64)
        stranger.settimeout(5)
        assert len(stranger.recv(64)) == 32, "only the host's nonce"
        assert stranger.recv(64) == b"", "then the host hangs up, having sent nothing else"
        stranger.close()
    finally:
        rank_node.close()
        host.close()


def test_the_kernel_s_progress_line_changes_only_when_a_merged_count_does():
    found = shares(
        "run", (plan("a", 1),), [(0,), (1,)], hosts=1, agents=["n0", "n1", "h0"], addresses=["a0", "a1", "a2"]
    )
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


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=1, max_size=3),  # ranks on each node of ranks
    st.booleans(),  # producers on nodes of their own (CPU nodes), else taking turns on the nodes of ranks
    st.lists(st.integers(1, 3), min_size=1, max_size=2),  # producers of each loader
    st.integers(0, 2**31),
)
def test_a_node_copies_in_every_row_it_does_not_write_from_the_merged_counters_and_keeps_its_own(
    ranks_per_node, cpu_nodes, producers, seed
):
    """Before a new process takes over a dead rank's share on its node, the node's counters get the rows other
    nodes write (their producers', their ranks') from the kernel's merge of every node's copy; the rows its own
    processes write stay as they are, newer than any copy that went round."""
    rng = random.Random(seed)
    first, ranks_by_node = 0, []
    for count in ranks_per_node:
        ranks_by_node.append(tuple(range(first, first + count)))
        first += count
    hosts = sum(producers) if cpu_nodes else 0
    nodes = len(ranks_by_node) + hosts
    loaders = tuple(plan(f"l{n}", count) for n, count in enumerate(producers))
    found = shares("run", loaders, ranks_by_node, hosts, [f"n{i}" for i in range(nodes)], ["127.0.0.1"] * nodes)
    world = found[0].world
    truth = [[rng.randrange(1, 1000) for _ in range(Counters.size(p, world) // 8)] for p in producers]

    def owned(node: int, number: int, stale: bool) -> list[int]:
        """What node ``node``'s copy of loader ``number``'s counters holds: its own rows true, others stale."""
        copy = Counters(producers[number], world)
        copy.take_rows([-1] * len(truth[number]) if stale else truth[number], range(producers[number]), range(world))
        copy.take_rows(truth[number], found[node].hosted[number], found[node].ranks)
        return copy.snapshot()

    progress = RunProgress(found)
    for node in range(nodes):
        progress.merge(node, [owned(node, number, stale=True) for number in range(len(loaders))])
    assert progress.snapshots() == truth
    for node in range(len(ranks_by_node)):
        delivery = NodeDelivery(dataclasses.replace(found[node], listen=""))
        try:
            for number, loader in enumerate(delivery.loaders):
                loader.counters.take_rows(owned(node, number, stale=True), range(producers[number]), range(world))
            newer = [[value + 1 for value in copy] for copy in truth]  # its own rows moved on since the merge
            for number, loader in enumerate(delivery.loaders):
                loader.counters.take_rows(newer[number], found[node].hosted[number], found[node].ranks)
            delivery.take_counters(progress.snapshots())
            for number, loader in enumerate(delivery.loaders):
                expected = Counters(producers[number], world)
                expected.take_rows(truth[number], range(producers[number]), range(world))
                expected.take_rows(newer[number], found[node].hosted[number], found[node].ranks)
                assert loader.counters.snapshot() == expected.snapshot()
        finally:
            delivery.close()


@pytest.mark.parametrize("splice", [True, False], ids=["spliced", "through a buffer"])
def test_an_element_s_bytes_arrive_whole_in_a_file_of_their_own(splice):
    from taas_magic.wire import memfile

    data = os.urandom(3 * relay.CHUNK + 123)
    source = memfile.new_file("element", len(data))
    os.pwrite(source, data, 0)
    host, node = socket.socketpair()
    reader = relay.Reader()
    if not splice:
        reader.close()  # no pipe: the buffer's way
    try:
        sender = threading.Thread(
            target=lambda: (relay.send_element(host, 3, b"head", source), relay.send_last(host, 3))
        )
        sender.start()
        rank, header, fd = reader.receive(node)
        assert (rank, header, os.pread(fd, len(data) + 1, 0)) == (3, b"head", data)
        os.close(fd)
        assert reader.receive(node) == (3, b"", -1), "then that rank's last"
        sender.join()
        host.close()
        with pytest.raises(relay.RelayBroken, match="the stream ended after 0 of 16 bytes"):
            reader.receive(node)
    finally:
        reader.close()
        node.close()
        os.close(source)
