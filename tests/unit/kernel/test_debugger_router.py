"""The visual debugger's routing, without a socket: each rank's ids (numbered from 1 by its engine) given numbers of
their own for the front end and taken back, the rank a request is for, each request as its rank must read it and
each reply as the front end must, the ranks' threads as the front end lists them, and JupyterLab's ``continue``."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.kernel.debugging.debugger_router import ID_KEYS, KINDS, RANK_IDS, Router, translate, unanswered


@dataclass(frozen=True)
class Rank:
    """A stand-in for a connected rank's engine: all the router reads of one is its label."""

    number: int

    @property
    def label(self) -> str:
        return f"rank {self.number}"


KEY_OF_KIND = {"threads": "threadId", "frames": "frameId", "variables": "variablesReference"}
rank_ids = st.integers(min_value=1, max_value=RANK_IDS * 4)  # a rank's own ids: any positive number
kernel_ids = st.integers(min_value=0, max_value=RANK_IDS - 1)  # the kernel's own counters stay below RANK_IDS
json_leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
names = st.text(min_size=1, max_size=8)
NO_ID_KEYS = names.filter(lambda key: key not in ID_KEYS and key not in ("id", "threads", "stackFrames"))


def json_values(keys: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        json_leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
        max_leaves=20,
    )


def message(command: str, arguments: dict[str, Any], seq: int = 7) -> dict[str, Any]:
    return {"type": "request", "seq": seq, "command": command, "arguments": arguments}


def accept_all(name: str) -> bool:
    return True


# -- ids ---------------------------------------------------------------------------------------------------


@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from(KINDS), rank_ids), min_size=1, max_size=40))
def test_each_ranks_ids_come_back_as_that_ranks_own_and_no_two_share_a_number(seen):
    router: Router[Rank] = Router()
    given_out: dict[tuple[Rank, str, int], int] = {}
    for number, kind, theirs in seen:
        rank = Rank(number)
        ours = router.ids[kind].outward(rank, theirs)
        assert ours >= RANK_IDS, "a number the kernel's own counters could reach"
        assert given_out.setdefault((rank, kind, theirs), ours) == ours, "the same id numbered twice"
    for kind in KINDS:
        numbers = [ours for (_, of_kind, _), ours in given_out.items() if of_kind == kind]
        assert len(set(numbers)) == len(numbers), f"two ranks' {kind} share a number"
    for (rank, kind, theirs), ours in given_out.items():
        key = KEY_OF_KIND[kind]
        assert router.ids[kind].inward(ours) == (rank, theirs)
        assert router.owner({key: ours}) == rank
        assert router.inward({key: ours}) == {key: theirs}
        assert router.request(message("variables", {key: ours})) == ("variables", {key: theirs})


@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from(KINDS), rank_ids), max_size=20), kernel_ids)
def test_the_kernels_own_ids_are_never_claimed_by_a_rank_and_pass_untouched(seen, number):
    router: Router[Rank] = Router()
    for rank, kind, theirs in seen:
        router.ids[kind].outward(Rank(rank), theirs)
    for kind, key in KEY_OF_KIND.items():
        assert router.ids[kind].inward(number) is None
        assert router.owner({key: number}) is None
        assert router.inward({key: number}) == {key: number}


@given(st.integers(max_value=0))
def test_no_variables_to_expand_stays_zero(number):
    router: Router[Rank] = Router()
    assert router.outward(Rank(0), {"variablesReference": number}) == {"variablesReference": number}
    assert router.ids["variables"].of(Rank(0)) == []


def test_a_rank_forgotten_takes_its_numbers_with_it_and_leaves_the_others():
    router: Router[Rank] = Router()
    gone, staying = Rank(0), Rank(1)
    gone_thread = router.ids["threads"].outward(gone, 1)
    staying_thread = router.ids["threads"].outward(staying, 1)
    assert router.ids["threads"].of(gone) == [gone_thread]
    router.ids["threads"].forget(gone)
    assert router.owner({"threadId": gone_thread}) is None and router.ids["threads"].of(gone) == []
    assert router.owner({"threadId": staying_thread}) == staying
    assert router.ids["threads"].outward(gone, 1) not in (gone_thread, staying_thread), "a number given out again"


# -- the rank a request is for -----------------------------------------------------------------------------


@given(
    others=st.dictionaries(NO_ID_KEYS, json_leaves, max_size=5),
    key=st.sampled_from(sorted(ID_KEYS)),
    kernels=st.dictionaries(st.sampled_from(sorted(ID_KEYS)), kernel_ids, max_size=3),
    rank=st.integers(0, 3),
    theirs=rank_ids,
)
def test_a_request_is_for_the_rank_whose_id_it_names_whatever_else_it_holds(others, key, kernels, rank, theirs):
    """Whatever else: other fields, and ids of the kernel's own (a frame of a rank's thread names no thread)."""
    router: Router[Rank] = Router()
    ours = router.ids[ID_KEYS[key]].outward(Rank(rank), theirs)
    assert router.owner({**others, **kernels, key: ours}) == Rank(rank)
    assert router.owner(others) is None, "no id of a rank's: the kernel's own request"
    assert router.owner({**others, key: str(ours)}) is None, "an id is a number"


@given(key=st.sampled_from(sorted(ID_KEYS)), unknown=st.integers(min_value=RANK_IDS))
def test_a_number_no_rank_was_given_is_nobodys(key, unknown):
    router: Router[Rank] = Router()
    assert router.owner({key: unknown}) is None
    assert router.inward({key: unknown}) == {key: unknown}


# -- ids in nested messages ----------------------------------------------------------------------------------


def plus_one(kind: str, number: int) -> int:
    return number + 1


def minus_one(kind: str, number: int) -> int:
    return number - 1


@given(json_values(NO_ID_KEYS))
def test_a_value_without_ids_comes_back_as_it_was_and_nothing_is_swapped(value):
    def swap(kind: str, number: int) -> int:
        raise AssertionError(f"swapped {kind} {number}")

    assert translate(value, swap) == value


@given(json_values(st.sampled_from([*ID_KEYS, "id", "threads", "stackFrames", "name", "body", "source"])))
def test_ids_swapped_and_swapped_back_give_the_value_back_and_leave_it_untouched(value):
    before = copy.deepcopy(value)
    assert translate(translate(value, plus_one), minus_one) == value
    assert value == before, "translate changed what it was given"


@given(
    st.sampled_from(sorted(ID_KEYS)),
    st.integers(1, 1000),
    st.lists(st.sampled_from(["list", "dict"]), max_size=6),
    NO_ID_KEYS,
)
def test_an_id_is_swapped_however_deep_it_is(key, number, wrappers, other_key):
    value: Any = {key: number, other_key: number}
    expected: Any = {key: number + 1, other_key: number}
    for wrapper in wrappers:
        value, expected = ([value], [expected]) if wrapper == "list" else ({"body": value}, {"body": expected})
    assert translate(value, plus_one) == expected


def test_the_id_of_a_thread_or_frame_in_its_list_is_of_that_kind_and_elsewhere_nobodys():
    def tagged(kind: str, number: int) -> int:
        return number + {"threads": 100, "frames": 200, "variables": 300}[kind]

    value = {
        "threads": [{"id": 1, "name": "MainThread"}],
        "stackFrames": [{"id": 2, "source": {"path": "x.py", "id": 5}}],
        "scopes": [{"id": 3, "variablesReference": 4}],
        "id": 6,
    }
    assert translate(value, tagged) == {
        "threads": [{"id": 101, "name": "MainThread"}],
        "stackFrames": [{"id": 202, "source": {"path": "x.py", "id": 5}}],
        "scopes": [{"id": 3, "variablesReference": 304}],
        "id": 6,
    }


# -- requests as the rank receives them ----------------------------------------------------------------------


@given(destination=st.text(max_size=10), source=st.text(max_size=10), frame=rank_ids)
def test_copy_to_globals_reaches_the_rank_as_the_assignment_it_stands_for(destination, source, frame):
    router: Router[Rank] = Router()
    ours = router.ids["frames"].outward(Rank(2), frame)
    arguments = {"dstVariableName": destination, "srcVariableName": source, "srcFrameId": ours}
    assert router.request(message("copyToGlobals", arguments)) == (
        "setExpression",
        {"expression": f"globals()[{destination!r}]", "value": source, "frameId": frame},
    )


def test_a_request_without_arguments_reaches_the_rank_with_none():
    router: Router[Rank] = Router()
    assert router.request({"seq": 1, "command": "threads"}) == ("threads", {})


# -- replies as the front end receives them ------------------------------------------------------------------


@given(
    command=st.sampled_from(["continue", "evaluate", "scopes", "copyToGlobals", "setVariable"]),
    seq=st.integers(1, 10**6),
    answer=st.fixed_dictionaries(
        {"success": st.booleans(), "seq": st.integers(), "request_seq": st.integers(), "command": st.text()},
        optional={"body": st.dictionaries(NO_ID_KEYS, json_leaves, max_size=3), "message": st.text()},
    ),
)
def test_a_reply_answers_the_front_ends_request_whatever_the_rank_numbered_it(command, seq, answer):
    router: Router[Rank] = Router()
    reply = router.reply(Rank(0), answer, message(command, {}, seq), "/cell.py", accept_all)
    assert (reply["type"], reply["command"], reply["request_seq"], reply["seq"]) == ("response", command, seq, seq)
    assert reply["success"] is answer["success"]
    for key in ("body", "message"):
        assert reply.get(key) == answer.get(key)


CELL = "/tmp/ipykernel_1/22.py"
frame_names = st.sampled_from(["step", "forward", "run_cell_magic", "<lambda>", "main"])
frame_paths = st.sampled_from(["/tmp/ipykernel_1/5.py", "/ipython/interactiveshell.py", CELL])


@given(
    above=st.lists(st.tuples(frame_names, frame_paths), max_size=6),
    below=st.lists(st.tuples(st.sampled_from(["<module>", "run_code"]), frame_paths), max_size=6),
    start=st.integers(0, 50),
    total=st.integers(0, 100),
)
def test_a_ranks_stack_ends_at_its_cells_frame_and_names_the_rank(above, below, start, total):
    """The frames below the cell's own are how the rank came to run it (the kernel's, copied by the fork)."""
    router: Router[Rank] = Router()
    frames = [*above, ("<module>", CELL), *below]
    answer = {
        "success": True,
        "body": {
            "stackFrames": [{"id": i + 1, "name": n, "source": {"path": p}} for i, (n, p) in enumerate(frames)],
            "totalFrames": total,
        },
    }
    stack = message("stackTrace", {"threadId": 1, "startFrame": start})
    body = router.reply(Rank(3), answer, stack, CELL, accept_all)["body"]
    kept = frames[: len(above) + 1]
    assert [frame["name"] for frame in body["stackFrames"]] == [f"rank 3: {name}" for name, _ in kept]
    assert body["totalFrames"] == start + len(above) + 1
    assert [router.ids["frames"].inward(frame["id"]) for frame in body["stackFrames"]] == [
        (Rank(3), i + 1) for i in range(len(kept))
    ]
    assert len(answer["body"]["stackFrames"]) == len(frames), "the rank's answer itself was cut"


@given(frames=st.lists(st.tuples(frame_names, frame_paths), max_size=8), total=st.integers(0, 100))
def test_a_stack_without_the_cells_frame_is_kept_whole(frames, total):
    router: Router[Rank] = Router()
    frames.append(("<module>", "/tmp/ipykernel_1/5.py"))  # another cell's module frame: not this cell's
    answer = {
        "success": True,
        "body": {"stackFrames": [{"id": 1, "name": n, "source": {"path": p}} for n, p in frames], "totalFrames": total},
    }
    body = router.reply(Rank(1), answer, message("stackTrace", {"threadId": 1}), CELL, accept_all)["body"]
    assert [frame["name"] for frame in body["stackFrames"]] == [f"rank 1: {name}" for name, _ in frames]
    assert body["totalFrames"] == total


def test_a_failed_stack_trace_is_passed_on_as_it_came():
    router: Router[Rank] = Router()
    answer = {"success": False, "message": "rank 1: no such thread"}
    reply = router.reply(Rank(1), answer, message("stackTrace", {"threadId": 1}), CELL, accept_all)
    assert reply["success"] is False and reply["message"] == "rank 1: no such thread" and "body" not in reply


@given(st.lists(st.sampled_from(["x", "_hidden", "model", "__builtins__", "In"]), max_size=8))
def test_a_ranks_variables_are_those_the_kernels_filter_accepts(variable_names):
    router: Router[Rank] = Router()
    answer = {
        "success": True,
        "body": {"variables": [{"name": name, "value": "1", "variablesReference": 5} for name in variable_names]},
    }
    reply = router.reply(Rank(0), answer, message("variables", {}), CELL, lambda name: not name.startswith("_"))
    shown = reply["body"]["variables"]
    assert [v["name"] for v in shown] == [name for name in variable_names if not name.startswith("_")]
    assert all(router.ids["variables"].inward(v["variablesReference"]) == (Rank(0), 5) for v in shown)


def test_only_the_variables_request_is_filtered():
    router: Router[Rank] = Router()
    answer = {"success": True, "body": {"variables": [{"name": "_x", "variablesReference": 0}]}}
    reply = router.reply(Rank(0), answer, message("setVariable", {}), CELL, lambda name: False)
    assert reply["body"]["variables"] == [{"name": "_x", "variablesReference": 0}]


# -- a rank that gives no answer -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "error", "expected"),
    [
        ("continue", ConnectionError("rank 2 left the debugger"), {"success": True, "body": {}}),
        ("next", ConnectionError("rank 2 left the debugger"), {"success": True, "body": {}}),
        ("stepIn", ConnectionError("rank 2 left the debugger"), {"success": True, "body": {}}),
        ("stepOut", ConnectionError("rank 2 left the debugger"), {"success": True, "body": {}}),
        (
            "stackTrace",
            ConnectionError("rank 2 left the debugger"),
            {"success": False, "message": "rank 2: rank 2 left the debugger"},
        ),
        (
            "continue",
            TimeoutError("no answer to continue within 30 s"),
            {"success": False, "message": "rank 2: no answer to continue within 30 s"},
        ),
    ],
)
def test_a_rank_that_left_went_on_if_told_to_and_anything_else_failed(command, error, expected):
    assert unanswered(Rank(2), command, error) == expected


# -- the ranks' threads ----------------------------------------------------------------------------------------


def test_a_ranks_threads_are_named_after_it_and_taas_own_are_left_out():
    router: Router[Rank] = Router()
    answer = {
        "body": {
            "threads": [
                {"id": 1, "name": "MainThread"},
                {"id": 2, "name": "taas-lifeline"},
                {"id": 3, "name": "loader"},
                {"id": 4, "name": "taas-sampler"},
            ]
        }
    }
    entries = router.threads(Rank(2), answer)
    assert [entry["name"] for entry in entries] == ["rank 2", "rank 2: loader"]
    assert [router.ids["threads"].inward(entry["id"]) for entry in entries] == [(Rank(2), 1), (Rank(2), 3)]
    assert router.threads(Rank(2), {"success": False}) == []


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6))
def test_each_ranks_main_thread_is_its_own_entry(numbers):
    router: Router[Rank] = Router()
    entries = [
        entry
        for number in numbers
        for entry in router.threads(Rank(number), {"body": {"threads": [{"id": 1, "name": "MainThread"}]}})
    ]
    assert [entry["name"] for entry in entries] == [f"rank {number}" for number in numbers]
    assert len({entry["id"] for entry in entries}) == len(set(numbers))


# -- JupyterLab's continue ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shown", "thread", "kernel_stopped", "expected"),
    [
        ("rank", 1, set(), True),  # JupyterLab's continue of the rank it shows, naming thread 1
        ("rank", 5, {1}, True),  # a small id that is none of the kernel's stopped threads
        ("rank", 1, {1}, False),  # the kernel's own thread 1 is stopped: the continue is the kernel's
        (None, 1, set(), False),  # no rank shown
        ("unknown", 1, set(), False),  # shown: a number no rank holds (its rank has gone)
        ("rank", "rank's", set(), False),  # names the rank's thread itself: routed as it is
        ("rank", None, set(), False),  # no thread named
        ("rank", "1", set(), False),  # not a number
    ],
)
def test_a_continue_is_for_the_shown_rank_only_when_it_names_no_stopped_thread_of_the_kernels(
    shown, thread, kernel_stopped, expected
):
    router: Router[Rank] = Router()
    rank_thread = router.ids["threads"].outward(Rank(1), 1)
    shown_id = {"rank": rank_thread, "unknown": rank_thread + 1, None: None}[shown]
    arguments = {} if thread is None else {"threadId": rank_thread if thread == "rank's" else thread}
    assert router.continues_the_shown_rank(arguments, kernel_stopped, shown_id) is expected


# -- a variable's rich display -----------------------------------------------------------------------------------


def test_a_variables_rich_display_is_evaluated_in_its_rank_and_read_back():
    router: Router[Rank] = Router()
    frame = router.ids["frames"].outward(Rank(1), 4)
    request = message("richInspectVariables", {"variableName": "image", "frameId": frame})
    evaluation = router.rich_request(request)
    assert evaluation is not None and evaluation["frameId"] == 4 and evaluation["context"] == "clipboard"
    assert ".rich(image)" in evaluation["expression"]
    result = repr(({"text/plain": "img", "image/png": "AAA"}, {"image/png": {"width": 3}, "text/html": {}}))
    reply = router.rich_reply(request, {"success": True, "body": {"result": result}})
    assert reply["body"] == {"data": {"text/plain": "img", "image/png": "AAA"}, "metadata": {"image/png": {"width": 3}}}
    assert (reply["success"], reply["command"], reply["request_seq"]) == (True, "richInspectVariables", 7)


@pytest.mark.parametrize("answer", [None, {"success": False}, {"success": True, "body": {"result": "<object at 0x1>"}}])
def test_a_rich_display_the_rank_could_not_give_is_empty_not_an_error(answer):
    router: Router[Rank] = Router()
    reply = router.rich_reply(message("richInspectVariables", {"variableName": "x"}), answer)
    assert reply["success"] is True and reply["body"] == {"data": {}, "metadata": {}}


@given(st.text(max_size=12).filter(lambda name: not name.isidentifier()))
def test_a_name_that_is_no_variables_is_not_evaluated(name):
    router: Router[Rank] = Router()
    assert router.rich_request(message("richInspectVariables", {"variableName": name})) is None
