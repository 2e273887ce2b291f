"""Where each rank's time went, and the rank the others waited for, from activity samples (kernel/view/time_shares.py)
and as the live view's summary shows it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from taas_magic.kernel.view.live_view import RunView
from taas_magic.kernel.view.time_shares import Shares, waited_for
from taas_magic.wire.records import Collective, RankActivity


def sample(state: str, at: float = 0.0, op: str = "all_reduce") -> RankActivity:
    """One sample of a rank: "computing", "data", "setup", or in a collective (``op``; "" when unnamed)."""
    if state == "collective":
        return RankActivity(at, 0.0, collectives=[Collective("0", 7, op, [[1]], ["Float"], 0.2)])
    if state == "data":
        return RankActivity(at, 0.0, waiting="train_loader", waited=0.5)
    if state == "setup":
        return RankActivity(at, 0.0, setup=1.0)
    return RankActivity(at, 0.0)


def shares_of(*states: str, op: str = "all_reduce") -> Shares:
    shares = Shares()
    for state in states:
        shares.add(sample(state, op=op))
    return shares


def test_a_ranks_shares_read_largest_first_with_the_collective_it_spent_them_in() -> None:
    shares = shares_of(*["computing"] * 6, *["collective"] * 3, "data")
    assert shares.text() == "computing 60% · all_reduce 30% · data 10%"
    assert shares_of("collective", "collective", op="").text() == "collectives 100%"
    mixed = shares_of("collective", op="all_reduce")
    mixed.add(sample("collective", op="broadcast"))
    assert mixed.text() == "collectives 100%", "several kinds are not given one kind's name"


def test_the_rank_that_computes_while_the_others_sit_in_all_reduce_is_named() -> None:
    ranks = {rank: shares_of(*["collective"] * 8, "computing", "computing") for rank in (0, 2, 3)}
    ranks[1] = shares_of(*["computing"] * 9, "collective")
    waited = waited_for(ranks)
    assert waited is not None and waited.ranks == (1,)
    assert waited.text() == "the others waited for rank 1: 80% of their time in all_reduce"


def test_two_slow_ranks_among_eight_are_named_together() -> None:
    ranks = {rank: shares_of(*["collective"] * 7, *["computing"] * 3) for rank in range(8)}
    ranks[5] = ranks[6] = shares_of(*["computing"] * 10)
    waited = waited_for(ranks)
    assert waited is not None and waited.text() == "the others waited for ranks 5-6: 70% of their time in all_reduce"


def test_a_balanced_run_names_nobody() -> None:
    ranks = {rank: shares_of(*["computing"] * 6, *["collective"] * 4) for rank in range(4)}
    assert waited_for(ranks) is None


def test_too_few_samples_name_nobody() -> None:
    assert waited_for({0: shares_of("collective"), 1: shares_of("computing")}) is None


@given(
    st.lists(
        st.lists(st.sampled_from(["computing", "collective", "data", "setup"]), min_size=4, max_size=40),
        min_size=2,
        max_size=8,
    )
)
def test_those_named_are_a_minority_far_below_the_others_in_collectives(runs: list[list[str]]) -> None:
    ranks = {rank: shares_of(*states) for rank, states in enumerate(runs)}
    waited = waited_for(ranks)
    if waited is None:
        return
    named = set(waited.ranks)
    assert len(named) <= len(ranks) - len(named)
    lowest_other = min(ranks[r].share("collectives") for r in ranks if r not in named)
    assert all(ranks[r].share("collectives") + 0.25 <= lowest_other + 1e-9 for r in named)
    assert 0.25 <= waited.share <= 1.0


@given(
    st.lists(st.sampled_from(["computing", "collective", "data", "setup"]), min_size=4, max_size=40), st.integers(2, 8)
)
def test_ranks_that_did_alike_name_nobody(states: list[str], world: int) -> None:
    assert waited_for({rank: shares_of(*states) for rank in range(world)}) is None


def test_the_summary_gives_the_shares_of_ranks_alike_on_one_line_and_names_the_rank_waited_for() -> None:
    view = RunView("3 ranks on cpu", [0, 1, 2])
    for second in range(10):
        for rank in (0, 2):
            view.take(rank, sample("collective" if second else "computing", at=second), now=second)
        view.take(1, sample("computing", at=second), now=second)
    summary = view.summary("done", 10.0)
    lines = summary["text/plain"].splitlines()
    assert [line.split()[:3] for line in lines[1:4]] == [["rank", str(rank), "stopped"] for rank in range(3)]
    assert lines[4:] == [
        "ranks 0,2: all_reduce 90% · computing 10%",
        "rank 1: computing 100%",
        "the others waited for rank 1: 90% of their time in all_reduce",
    ], lines
    assert summary["text/html"].count('class="taas-note"') == 3 and "waited for rank 1" in summary["text/html"]
    assert len(view.summary("done", 2.0)["text/plain"].splitlines()) == 4, "a run of a few seconds says nothing of it"
    running = view.render(10.0)["text/plain"].splitlines()
    assert running[2].endswith("computing 100%") and running[-1].startswith("the others waited for rank 1")
