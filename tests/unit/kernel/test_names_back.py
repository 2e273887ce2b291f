"""The end of a cell: what the ranks sent joins the notebook, and one line says what did not come back."""

from __future__ import annotations

import contextlib
import dataclasses
import io

from hypothesis import given
from hypothesis import strategies as st
from support.notebook_values import SETUP, TORCH_WARNINGS_OF_TENSORS
from support.notebook_values import values as notebook_values

from taas_magic.kernel.run.run_result import ONE_SHOT
from taas_magic.kernel.run.run_state import RunState
from taas_magic.kernel.running import names_back
from taas_magic.per_rank import PerRank
from taas_magic.wire import results

pytestmark = TORCH_WARNINGS_OF_TENSORS

NOTEBOOK: dict = {}
exec(SETUP, NOTEBOOK)
NOTHING = RunState(ONE_SHOT, 0.0).result()  # a run whose ranks sent nothing


def taken_back(namespace: dict, sent: dict[int, dict], requested: tuple[str, ...] | None = None) -> str:
    """What the ranks of ``sent`` send, taken back into ``namespace``; the line said, if any."""
    packed = {rank: results.dumps(values) for rank, values in sent.items()}
    result = dataclasses.replace(
        NOTHING,
        results={rank: names.to_bytes() for rank, (names, _) in packed.items()},
        skipped={rank: skipped for rank, (_, skipped) in packed.items() if skipped},
    )
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        names_back.take_back(namespace, result, requested, tuple(sent))
    return said.getvalue()


@given(expression=notebook_values())
def test_a_name_from_one_rank_joins_the_notebook_as_it_is_or_stays_as_it_was_with_one_line_why(expression):
    value = eval(expression, NOTEBOOK)
    namespace = {"x": "before", "n": 1}
    said = taken_back(namespace, {0: {"x": value, "n": None}})
    assert namespace["n"] is None, "None comes back as any value does"
    if said:
        assert namespace["x"] == "before" and said.startswith("taas: not copied back from rank 0: x ("), said
        assert said.count("\n") == 1
    else:
        assert type(namespace["x"]).__qualname__ == type(value).__qualname__  # a MagicMock's class is its own


@given(expression=notebook_values())
def test_a_name_from_several_ranks_joins_as_a_per_rank_of_the_ranks_it_came_back_from(expression):
    value = eval(expression, NOTEBOOK)
    namespace: dict = {}
    said = taken_back(namespace, {0: {"x": value, "n": None}, 2: {"x": value, "n": None}})
    assert isinstance(namespace["n"], PerRank) and namespace["n"].ranks == (0, 2) and list(namespace["n"]) == [None] * 2
    if said:
        assert "x" not in namespace and said.startswith("taas: not copied back from ranks 0,2: x ("), said
    else:
        assert namespace["x"].ranks == (0, 2)


def test_a_damaged_stream_leaves_every_name_out_in_one_line_and_the_other_ranks_names_come_back():
    good, _ = results.dumps({"x": 1})
    result = dataclasses.replace(NOTHING, results={0: b"\x00garbage", 1: good.to_bytes()})
    namespace: dict = {}
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        names_back.take_back(namespace, result, None, (0, 1))
    assert list(namespace["x"].items()) == [(1, 1)]
    assert said.getvalue().startswith(
        "taas: not copied back from rank 0: (all) (could not be unpickled in the kernel: "
    )


def test_a_name_the_rank_never_bound_is_said_only_when_the_cell_asked_for_it():
    namespace: dict = {}
    result = dataclasses.replace(
        NOTHING, results={0: results.dumps({})[0].to_bytes()}, skipped={0: {"y": results.NOT_BOUND}}
    )
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        names_back.take_back(namespace, result, None, (0,))
    assert said.getvalue() == "" and namespace == {}
    with contextlib.redirect_stderr(said):
        names_back.take_back(namespace, result, ("y",), (0,))
    assert said.getvalue() == f"taas: not copied back from rank 0: y ({results.NOT_BOUND})\n" and namespace == {}


@given(expression=notebook_values(), builtin=st.sampled_from(["list", "sum", "id", "input", "print", "type"]))
def test_a_name_that_hides_a_builtin_says_so_in_one_line_whatever_its_value(expression, builtin):
    value = eval(expression, NOTEBOOK)
    namespace: dict = {}
    said = taken_back(namespace, {0: {builtin: value}})
    if builtin not in namespace:
        return  # it did not come back (the line says why)
    assert said.endswith(
        f"taas: {builtin} came back from rank 0 and now hides Python's builtin of the same name in the notebook: "
        f"del {builtin} brings it back\n"
    ), said
    assert "builtin" not in taken_back(namespace, {0: {builtin: value}}), "hidden already: no word"


def test_a_builtin_itself_coming_back_hides_nothing():
    namespace: dict = {}
    assert taken_back(namespace, {0: {"len": len, "x": None}}) == "" and namespace["len"] is len
