"""`%taas resize N`, and a cluster session's lost node, in the kernel, driven by a scripted group of kept ranks: the one
cell every rank is sent,
the session's new size, and the one-line refusals before anything changes."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.specs import cpu_spec
from test_session import ScriptedSessionGroup, session_of

from taas_magic.configurations import Configuration
from taas_magic.errors import RankFailed, SessionEnded, TaasUsageError
from taas_magic.kernel.header import spec as launch_spec
from taas_magic.kernel.sessions import resizing
from taas_magic.kernel.sessions.kept import Kept
from taas_magic.kernel.sessions.session import Session
from taas_magic.kernel.view.front_end import CellFrontEnd
from taas_magic.wire.events import NODE_LOST, Event, Exited, Producer, Report
from taas_magic.wire.rank_control import SessionCell
from taas_magic.wire.records import CellEnded
from taas_magic.wire.task import LoaderPlan


def every_rank_ends(group: ScriptedSessionGroup, ranks: list[int]) -> list[Event]:
    return [Report(rank, CellEnded(1.0)) for rank in ranks]


def resize(session: Session, world: int) -> str:
    return resizing.resize(session, world, CellFrontEnd(lambda stream, text: None))


def test_fewer_ranks_end_those_beyond_and_the_others_connect_their_group_anew():
    group = ScriptedSessionGroup(every_rank_ends, world_size=4)
    session = session_of(group)
    session.failed = [1, 3]
    said = resize(session, 2)
    assert said.startswith("taas: the session has 2 ranks now: ranks 2-3 ended ("), said
    cell = group.sent[-1]
    assert (cell.regroup, cell.world, cell.newcomers, group.cells[-1]) == (True, 2, (), [0, 1])
    assert group.alive == {0, 1} and session.size == 2 and session.spec.ranks_per_node == 2
    assert session.failed == [1], "rank 3's error went with it"
    assert not session.ended and not group.closed


def test_more_ranks_join_as_newcomers_and_every_rank_takes_the_cell():
    group = ScriptedSessionGroup(every_rank_ends, world_size=2)
    session = session_of(group)
    session.sources_sent.add("cell-1.py")
    said = resize(session, 5)
    assert said.startswith("taas: the session has 5 ranks now: ranks 2-4 joined ("), said
    cell = group.sent[-1]
    assert (cell.world, cell.newcomers, group.cells[-1]) == (5, (2, 3, 4), [0, 1, 2, 3, 4])
    assert group.alive == set(range(5)) and session.size == 5
    assert session.sources_sent == set(), "the new ranks are sent every cell's source with the next cell"


class Loader:  # what the notebook binds: the session keeps a weak reference to it
    pass


def test_the_loaders_a_session_serves_are_planned_anew_for_its_new_size_by_producers_numbered_after_the_others():
    group = ScriptedSessionGroup(every_rank_ends, world_size=2)
    session = session_of(group)
    loaders = {"train_loader": Loader(), "valid_loader": Loader()}
    plans = tuple(LoaderPlan(name, 2, None, None, False, 7, on_demand=True) for name in loaders)
    assert session.serve(plans, loaders) == 0
    resize(session, 3)
    cell = group.sent[-1]
    assert (cell.world, cell.order.loaders, cell.first_loader) == (3, plans, 2), "numbered after the first two"
    assert session.labels[Producer(3, 1)] == "producer 1 of valid_loader"
    assert session.serves("train_loader", loaders["train_loader"]), "the notebook's loader is served as before"


def test_the_same_size_changes_nothing():
    group = ScriptedSessionGroup(every_rank_ends, world_size=3)
    session = session_of(group)
    assert resize(session, 3) == "taas: the session has 3 ranks already"
    assert group.sent == []


def test_a_rank_that_dies_as_the_session_is_resized_ends_it_saying_so():
    dying = [Report(0, CellEnded(1.0)), Exited(1, -signal.SIGKILL), Report(2, CellEnded(1.0))]
    group = ScriptedSessionGroup(lambda g, ranks: dying, world_size=2)
    session = session_of(group)
    with pytest.raises(SessionEnded) as caught:
        resize(session, 3)
    assert "could not be connected again as it was resized to 3 ranks" in str(caught.value), str(caught.value)
    assert session.ended and group.closed


@pytest.mark.parametrize(
    "change, refusal",
    [
        (
            {"start": "cluster"},
            "the session on the cluster serves registered loaders, whose producers were placed for its nodes",
        ),
        ({"device": "cuda"}, "its ranks are on cuda, and only a CPU session (gloo) can be resized"),
    ],
)
def test_a_session_that_cannot_be_resized_is_refused_in_one_line_before_anything_is_sent(change, refusal):
    group = ScriptedSessionGroup(every_rank_ends, world_size=2)
    session = session_of(group)
    if "start" in change:
        session.start = change["start"]
        session.serve((LoaderPlan("batches", 2, None, None, False, 7),), {"batches": Loader()})
    if "device" in change:
        session.spec = dataclasses.replace(session.spec, device=change["device"])
    with pytest.raises(TaasUsageError) as caught:
        resize(session, 4)
    assert str(caught.value) == f"%taas resize 4: {refusal}: %taas stop, then start a session of 4 with --keep"
    assert group.sent == [] and session.size == 2 and not session.ended


CONFIGURATIONS = st.one_of(
    st.none(),
    st.builds(Configuration, st.just("g2.8"), gpus=st.just(8), cpus=st.just(28)),
    st.builds(Configuration, st.just("c1.4"), gpus=st.just(0), cpus=st.just(4)),
)


@given(
    size=st.integers(1, 8),
    world=st.integers(-3, 300),
    configuration=CONFIGURATIONS,
    return_from=st.lists(st.integers(0, 7), min_size=1, max_size=3, unique=True),
    debug_ranks=st.one_of(st.none(), st.lists(st.integers(0, 7), max_size=3, unique=True)),
)
def test_the_resized_spec_has_the_new_size_on_one_node_and_names_only_its_ranks_or_the_error_names_the_range(
    size, world, configuration, return_from, debug_ranks
):
    spec = dataclasses.replace(
        cpu_spec(size),
        configuration=configuration,
        return_from=tuple(return_from),
        debug_ranks=None if debug_ranks is None else tuple(debug_ranks),
    )
    high = min(configuration.gpus or configuration.cpus, 256) if configuration else 256
    try:
        resized = launch_spec.resized(spec, world)
    except TaasUsageError as e:
        assert not 1 <= world <= high
        assert str(e).startswith(f"%taas resize {world}: the session can have 1 to {high} ranks") and "\n" not in str(e)
        return
    assert 1 <= world <= high
    assert (resized.world_size, resized.nodes, resized.ranks_per_node) == (world, 1, world)
    assert resized.return_from and all(rank < world for rank in resized.return_from)
    assert resized.debug_ranks is None or all(rank < world for rank in resized.debug_ranks)
    assert (resized.device, resized.configuration) == (spec.device, spec.configuration)


@given(words=st.lists(st.text(max_size=12), max_size=3))
def test_any_words_after_resize_are_a_number_or_one_line_saying_what_it_takes(words):
    kept = Kept()
    group = ScriptedSessionGroup(every_rank_ends, world_size=2)
    kept.session = session_of(group)
    number = len(words) == 1 and words[0].isascii() and words[0].isdigit() and len(words[0]) <= 9
    try:
        kept.resize_command(words)
    except TaasUsageError as e:
        message = str(e)
        assert "\n" not in message and message.startswith("%taas resize")
        assert not number or not 1 <= int(words[0]) <= 256
        return
    assert number and kept.session.size == int(words[0])


def test_resize_without_a_session_says_how_to_start_one():
    with pytest.raises(TaasUsageError, match="^%taas resize: no session is running"):
        Kept().resize_command(["2"])


def test_the_cell_names_who_leaves_and_who_joins():
    cell = SessionCell.resize(7, world=2, size=4)
    assert (cell.number, cell.world, cell.newcomers) == (7, 2, ())
    assert [cell.leaves(key) for key in (0, 1, 2, 3)] == [False, False, True, True]
    grown = SessionCell.resize(8, world=4, size=2)
    assert grown.newcomers == (2, 3) and not any(grown.leaves(key) for key in range(4))
    assert not SessionCell.reconnect(9, (1,)).leaves(1), "a heal keeps every rank"


def cluster_session(group: ScriptedSessionGroup, nodes: int) -> Session:
    size = len(group.alive)
    spec = dataclasses.replace(cpu_spec(size), nodes=nodes, ranks_per_node=size // nodes, on_cluster=True)
    return Session(group, spec, "cluster", known={}, sources_sent=set())


def losing(*lost: int) -> Callable[[ScriptedSessionGroup, list[int]], list[Event]]:
    """The first cell: ``lost`` ranks go with their node, the others end it; every later cell ends at once."""

    def script(group: ScriptedSessionGroup, ranks: list[int]) -> list[Event]:
        if len(group.cells) > 1:
            return every_rank_ends(group, ranks)
        return [Exited(rank, NODE_LOST) if rank in lost else Report(rank, CellEnded(1.0)) for rank in ranks]

    return script


def test_a_cluster_session_that_loses_its_last_node_goes_on_with_the_other_nodes_ranks():
    group = ScriptedSessionGroup(losing(2, 3), world_size=4)
    session = cluster_session(group, nodes=2)
    with pytest.raises(RankFailed) as caught:
        session.run(SessionCell.post_mortem(), None, [0, 1, 2, 3], session.spec, CellFrontEnd(lambda s, t: None))
    assert str(caught.value) == "rank 2 failed: lost with its node"
    assert caught.value.lines[-1] == "taas: the session goes on without ranks 2-3, lost with their node"
    cell = group.sent[-1]
    assert (cell.regroup, cell.world, cell.nodes, cell.newcomers, group.cells[-1]) == (True, 2, 1, (), [0, 1])
    assert (session.size, session.spec.nodes, session.spec.ranks_per_node) == (2, 1, 2)
    assert not session.ended and not group.closed


def test_a_cluster_session_that_loses_a_node_whose_ranks_are_not_the_last_ends():
    group = ScriptedSessionGroup(losing(2, 3), world_size=6)
    session = cluster_session(group, nodes=3)
    with pytest.raises(SessionEnded, match="ranks 2-3 were lost with their node, and a session goes on only without"):
        session.run(SessionCell.post_mortem(), None, list(range(6)), session.spec, CellFrontEnd(lambda s, t: None))
    assert session.ended and group.closed


def test_a_cluster_session_whose_last_node_is_lost_between_cells_goes_on_without_it_at_the_next_cell(capsys):
    group = ScriptedSessionGroup(every_rank_ends, world_size=4)
    session = cluster_session(group, nodes=2)
    group.waiting = [Exited(2, NODE_LOST), Exited(3, NODE_LOST)]
    assert session.check() == ""
    assert "taas: rank 3 lost with its node between cells: it goes on without it as the next taas cell" in (
        capsys.readouterr().err
    )
    session.run(SessionCell.post_mortem(), None, [0, 1], session.spec, CellFrontEnd(lambda s, t: None))
    resized, cell = group.sent
    assert (resized.world, resized.nodes, group.cells) == (2, 1, [[0, 1], [0, 1]])
    assert session.size == 2


class GrowingScriptedGroup(ScriptedSessionGroup):
    """A cluster's group: its new ranks are started (``grow``) before the cell that makes them join; or it refuses."""

    def __init__(self, script: Callable[[ScriptedSessionGroup, list[int]], list[Event]], world_size: int, held: int):
        super().__init__(script, world_size)
        self.held = held  # the ranks the cluster's nodes can hold
        self.grown: list[tuple[int, int]] = []

    def grow(self, world: int, nodes: int) -> None:
        if world > self.held:
            raise TaasUsageError(f"the cluster has nodes for {self.held} ranks in all")
        self.grown.append((world, nodes))


@given(nodes=st.integers(1, 4), per_node=st.integers(1, 4), held=st.integers(1, 4), to=st.integers(0, 17))
def test_a_cluster_session_is_resized_by_whole_nodes_grown_onto_its_nodes_first_or_refused_in_one_line(
    nodes, per_node, held, to
):
    held = max(held, nodes)
    group = GrowingScriptedGroup(every_rank_ends, world_size=nodes * per_node, held=held * per_node)
    session = cluster_session(group, nodes=nodes)
    size = session.size
    if to < per_node or to % per_node or to > held * per_node:
        with pytest.raises(TaasUsageError) as caught:
            resize(session, to)
        assert str(caught.value).startswith(f"%taas resize {to}: ") and "\n" not in str(caught.value)
        assert (group.sent, group.grown, session.size) == ([], [], size), "nothing changed"
        return
    said = resize(session, to)
    if to == size:
        assert said == f"taas: the session has {size} rank{'s' * (size > 1)} already" and group.sent == []
        return
    cell = group.sent[-1]
    assert (cell.world, cell.nodes, group.cells[-1]) == (to, to // per_node, list(range(to)))
    assert (session.size, session.spec.nodes, session.spec.ranks_per_node) == (to, to // per_node, per_node)
    assert group.grown == ([(to, to // per_node)] if to > size else []), "started before the cell, only to grow"
    assert cell.newcomers == tuple(range(size, to)) and group.alive == set(range(to))
