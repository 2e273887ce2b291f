"""The visual debugger's focus: whatever the ranks' engines send, in whatever order and from however many threads
at once, the front end is told each stop, each continue and each exit once, in the order they came, and the
snapshot other threads read says which rank threads are stopped and which one the front end shows."""

from __future__ import annotations

import socket
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from taas_magic.kernel.debugging import debugger_focus
from taas_magic.kernel.debugging.debugger_focus import Focus
from taas_magic.kernel.debugging.debugger_router import Ids
from taas_magic.kernel.debugging.rank_engines import RankEngine


def ranks(count: int) -> list[RankEngine]:
    engines = []
    for number in range(count):
        ours, theirs = socket.socketpair()
        engine = RankEngine(ours, lambda rank, event: None, lambda rank: None)
        engine.name("run", number)
        engine.peer = theirs  # type: ignore[attr-defined]  # kept open: nothing is read from it
        engines.append(engine)
    return engines


def focus_of(show_next_seconds: float = debugger_focus.SHOW_NEXT_SECONDS) -> tuple[Focus, list[tuple[str, dict]]]:
    published: list[tuple[str, dict]] = []
    ids = {kind: Ids() for kind in ("threads", "frames", "variables")}
    return Focus(ids, lambda kind, body: published.append((kind, body)), show_next_seconds), published


# (rank, thread, what): a thread of a rank stops, goes on, or all the rank's threads go on
steps = st.lists(
    st.tuples(st.integers(0, 2), st.integers(1, 3), st.sampled_from(["stopped", "continued", "all continued"])),
    max_size=25,
)


@settings(max_examples=60)
@given(steps)
def test_any_order_of_stops_and_continues_leaves_the_stopped_threads_as_they_are_and_shows_the_last_stop(sequence):
    focus, published = focus_of(show_next_seconds=3600)  # no other rank is shown meanwhile, however slow the test
    engines = ranks(3)
    expected: dict[int, set[int]] = {0: set(), 1: set(), 2: set()}
    shown = None  # (rank, thread) of the last stop told, until that thread goes on
    for rank, thread, what in sequence:
        if what == "stopped":
            focus.rank_event(engines[rank], {"event": "stopped", "body": {"threadId": thread, "reason": "step"}})
            expected[rank].add(thread)
            shown = (rank, thread)
        elif what == "continued":
            focus.rank_event(engines[rank], {"event": "continued", "body": {"threadId": thread}})
            expected[rank].discard(thread)
            shown = None if shown == (rank, thread) else shown
        else:
            focus.rank_event(
                engines[rank], {"event": "continued", "body": {"threadId": 1, "allThreadsContinued": True}}
            )
            gone = expected[rank]
            shown = None if shown is not None and shown[0] == rank and shown[1] in gone else shown
            expected[rank] = set()
    assert focus.settle()
    now = focus.now
    outward = focus.ids["threads"].outward
    assert {rank: set(threads) for rank, threads in now.stopped.items() if threads} == {
        rank: {outward(engines[rank], t) for t in threads} for rank, threads in expected.items() if threads
    }
    assert now.stopped_ranks() == {rank for rank, threads in expected.items() if threads}
    assert now.shown == (None if shown is None else outward(engines[shown[0]], shown[1]))
    stops = [body["threadId"] for kind, body in published if kind == "stopped"]
    assert len(stops) == sum(what == "stopped" for _, _, what in sequence), "each stop told once, no more yet"
    focus.forget_the_next_show()


def both_stopped_then_the_second_goes_on() -> tuple[Focus, list[tuple[str, dict]], RankEngine, RankEngine]:
    """Two ranks stopped at a breakpoint, the second (shown, as the last to stop) told to go on."""
    focus, published = focus_of()
    first, second = ranks(2)
    focus.rank_event(first, {"event": "stopped", "body": {"threadId": 1, "reason": "breakpoint"}})
    focus.rank_event(second, {"event": "stopped", "body": {"threadId": 1, "reason": "breakpoint"}})
    focus.rank_event(second, {"event": "continued", "body": {"threadId": 1}})
    return focus, published, first, second


def test_after_the_shown_rank_goes_on_the_last_rank_still_stopped_is_shown():
    focus, published, first, _ = both_stopped_then_the_second_goes_on()
    time.sleep(debugger_focus.SHOW_NEXT_SECONDS + 0.3)
    assert focus.settle()
    first_thread = focus.ids["threads"].outward(first, 1)
    assert published[-1] == ("stopped", {"threadId": first_thread, "reason": "breakpoint", "allThreadsStopped": False})
    assert focus.now.shown == first_thread


def test_a_step_that_stops_again_at_once_keeps_the_front_end_on_that_rank():
    focus, published, _, second = both_stopped_then_the_second_goes_on()
    focus.rank_event(second, {"event": "stopped", "body": {"threadId": 1, "reason": "step"}})
    time.sleep(debugger_focus.SHOW_NEXT_SECONDS + 0.3)
    assert focus.settle()
    assert focus.now.shown == focus.ids["threads"].outward(second, 1)
    assert [kind for kind, _ in published] == ["stopped", "stopped", "continued", "stopped"]


def test_a_rank_that_goes_away_lets_its_threads_go_on_and_exit_and_its_ids_are_forgotten():
    focus, published = focus_of()
    (engine,) = ranks(1)
    focus.rank_event(engine, {"event": "stopped", "body": {"threadId": 1, "reason": "breakpoint"}})
    focus.rank_event(engine, {"event": "thread", "body": {"threadId": 2, "reason": "started"}})
    assert focus.settle()
    ids = [focus.ids["threads"].outward(engine, t) for t in (1, 2)]
    focus.rank_gone(engine)
    assert focus.settle()
    assert focus.now.stopped_ranks() == frozenset() and focus.now.shown is None
    assert ("continued", {"threadId": ids[0], "allThreadsContinued": False}) in published
    exits = [body["threadId"] for kind, body in published if kind == "thread" and body["reason"] == "exited"]
    assert sorted(exits) == sorted(ids)
    assert focus.ids["threads"].inward(ids[0]) is None


def test_events_from_many_rank_threads_at_once_are_told_whole_and_the_focus_thread_leaves_when_idle():
    focus, published = focus_of()
    engines = ranks(8)
    start = threading.Barrier(len(engines))

    def send(engine: RankEngine) -> None:
        start.wait()
        for step in range(50):
            focus.rank_event(engine, {"event": "stopped", "body": {"threadId": 1 + step % 3, "reason": "step"}})
            focus.rank_event(engine, {"event": "continued", "body": {"threadId": 1 + step % 3}})

    senders = [threading.Thread(target=send, args=(engine,)) for engine in engines]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    assert focus.settle(timeout=30)
    assert [kind for kind, _ in published].count("stopped") >= 8 * 50
    assert focus.now.stopped_ranks() == frozenset()
    deadline = time.monotonic() + debugger_focus.IDLE_SECONDS + debugger_focus.SHOW_NEXT_SECONDS + 5
    while focus.serving() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not focus.serving(), "idle, the thread is gone"


def test_a_rank_dropped_as_the_client_detaches_is_no_longer_stopped_and_nothing_is_told():
    focus, published = focus_of()
    (engine,) = ranks(1)
    focus.rank_event(engine, {"event": "stopped", "body": {"threadId": 1, "reason": "breakpoint"}})
    assert focus.settle() and focus.now.stopped_ranks() == {0}
    told = len(published)
    focus.rank_dropped(engine)
    focus.forget_the_next_show()
    assert focus.settle()
    assert focus.now.stopped_ranks() == frozenset() and len(published) == told
