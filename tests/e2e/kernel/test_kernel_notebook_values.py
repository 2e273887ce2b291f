"""Ordinary notebook values cross the boundary with the ranks, in every start mode.

Whatever a person binds to a name (None, 0, NaN, a mock, an object whose ``__eq__`` raises, a
module…) reaches the cell's analysis, shipping and the results that come back. A taas cell that
reads such names runs, or fails before anything starts with taas's one-line message naming the
value; names the cell binds come back, or one line names those that cannot. The catalogue and
the strategy are in ``notebook_values.py``; the cluster's version is in test_cluster.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.kernel import Kernel
from support.notebook_values import KINDS, SETUP, unpicklable, values

MODES = ["--start fork", "--start forkserver", "--start fork --keep", "--start forkserver --keep"]


@pytest.fixture(scope="module")
def notebook():
    k = Kernel(warm_fork_server=False)
    k.execute(SETUP).ok()
    yield k
    k.shutdown()


def bind(kernel: Kernel, expressions: dict[str, str]) -> None:
    """Bind the notebook's names, and forget what earlier cells brought back."""
    kernel.execute(
        "for _name in [n for n in globals() if n.startswith(('back_', 'made_'))]:\n"
        "    del globals()[_name]\n" + "".join(f"{name} = {expression}\n" for name, expression in expressions.items())
    ).ok()


def cell_reading(expressions: dict[str, str]) -> str:
    """A cell that reads each name, binds it again (``back_``) and makes the same kind of value (``made_``)."""
    names = ", ".join(expressions)
    return f"print('kinds', [type(v).__name__ for v in ({names},)], flush=True)\n" + "".join(
        f"back_{name} = {name}\nmade_{name} = {expression}\n" for name, expression in expressions.items()
    )


def check_cell(kernel: Kernel, header: str, expressions: dict[str, str], may_refuse: bool) -> None:
    """The cell either runs in both ranks and its names come back, or is refused in one line naming
    a value that cannot be pickled, before anything ran."""
    expected = kernel.value(f"[type(v).__name__ for v in ({', '.join(expressions)},)]")
    r = kernel.execute(header + "\n" + cell_reading(expressions), timeout=120)
    refused = [name for name, expression in expressions.items() if unpicklable(expression)]
    if r.error is not None:
        assert may_refuse and refused, f"{r.error['ename']}: {r.error['evalue']}\n{r.traceback}"
        assert r.error["ename"] == "TaasUsageError" and "\n" not in r.error["evalue"], r.error
        assert any(f"the cell needs {name!r}" in r.error["evalue"] for name in refused), r.error["evalue"]
        assert "kinds" not in r.stdout, "nothing ran"
        return
    seen = r.each_rank()
    for rank in (0, 1):
        assert f"[rank {rank}] kinds {expected!r}" in seen, (expressions, r.stdout, r.stderr)
    for name, expression in expressions.items():
        for came in (f"back_{name}", f"made_{name}"):
            kind = kernel.value(f"type({came}).__name__ if {came!r} in globals() else None")
            if unpicklable(expression):
                assert kind is None and came in r.stderr and "not copied back from rank 0" in r.stderr, r.stderr
            else:
                assert kind == type_name(kernel, expression), (came, expression, r.stderr)


def type_name(kernel: Kernel, expression: str) -> str:
    return kernel.value(f"type({expression}).__name__")


@pytest.mark.parametrize("mode", MODES)
def test_every_kind_of_notebook_value_is_read_sent_and_brought_back(notebook, mode):
    """Each kind once, all in one cell, twice: the second time with every name bound anew (a
    session's ranks must be sent the new values). Where the generator cannot go, it alone is
    named, and the cell without it runs."""
    session = "--keep" in mode
    everything = {f"v_{kind}": expression for kind, expression in KINDS.items()}
    picklable = {name: expression for name, expression in everything.items() if not unpicklable(expression)}
    try:
        for attempt in range(2 if session else 1):
            header = f"#pragma taas --gpus 2 {mode}" if attempt == 0 else "#pragma taas"
            bind(notebook, everything)
            if "forkserver" in mode or attempt == 1:  # values must be pickled to reach these ranks
                r = notebook.execute(header + "\n" + cell_reading(everything), timeout=120)
                assert r.error is not None and r.error["ename"] == "TaasUsageError", r.error
                assert r.error["evalue"].startswith("the cell needs 'v_generator' (a builtins.generator)"), r.error
                check_cell(notebook, header, picklable, may_refuse=False)
            else:
                check_cell(notebook, header, everything, may_refuse=False)
    finally:
        notebook.execute("%taas stop")


@pytest.mark.parametrize("mode", MODES)
def test_generated_notebook_values_run_or_are_refused_in_one_line_naming_them(notebook, mode):
    session = "--keep" in mode
    if session:
        notebook.execute(f"#pragma taas --gpus 2 {mode}\nstarted = True").ok()
    header = "#pragma taas" if session else f"#pragma taas --gpus 2 {mode}"
    may_refuse = session or "forkserver" in mode

    @settings(
        max_examples=20,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.lists(values(), min_size=1, max_size=3))
    def cell_with(expressions: list[str]) -> None:
        named = {f"v{index}": expression for index, expression in enumerate(expressions)}
        bind(notebook, named)
        check_cell(notebook, header, named, may_refuse)

    try:
        cell_with()
    finally:
        if session:
            notebook.execute("%taas stop")


REBIND_IN_PLACE = """
def rebind_in_place(name, make):
    \"\"\"Bind ``name`` anew to a value ``make(i)`` that lies where its old value lay (freed first).\"\"\"
    old = id(globals()[name])
    globals()[name] = None
    kept = []
    for i in range(1, 200000):
        value = make(i)
        if id(value) == old:
            globals()[name] = value
            return True
        kept.append(value)
    return False
"""


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_a_session_is_sent_a_new_value_that_took_a_freed_ones_place(notebook, start):
    """A name bound anew to an object at the address of the one the ranks were sent (freed
    meanwhile, its place taken by the new one) is a new value: the ranks get it, not the stale one."""
    notebook.execute(REBIND_IN_PLACE + "lr = float('0.25')\npoint = Point(0, 2.0)").ok()
    notebook.execute(f"#pragma taas --gpus 2 --keep --start {start}\nprint('was', lr, point.x, flush=True)").ok()
    try:
        assert notebook.value(
            "(rebind_in_place('lr', lambda i: i + 0.5), rebind_in_place('point', lambda i: Point(i, 2.0)))"
        ) == (True, True), "the test must reuse the freed objects' addresses to mean anything"
        lr, x = notebook.value("(lr, point.x)")
        r = notebook.execute("#pragma taas\nprint('now', lr, point.x, flush=True)").ok()
        assert f"[rank 1] now {lr} {x}" in r.each_rank(), r.stdout
    finally:
        notebook.execute("%taas stop")


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_generated_values_pushed_to_a_session_come_back_from_every_rank_when_pulled(notebook, start):
    """``%taas push`` then ``%taas pull`` of whatever a person binds: each name comes back as a PerRank of
    the same kind of value from each rank, or the push is refused in one line naming what cannot go."""
    notebook.execute(f"#pragma taas --gpus 2 --start {start} --keep --return none\nstarted = True").ok()

    @settings(
        max_examples=12,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(st.lists(values(), min_size=1, max_size=3))
    def round_trip(expressions: list[str]) -> None:
        named = {f"p{index}": expression for index, expression in enumerate(expressions)}
        bind(notebook, named)
        kinds = {name: type_name(notebook, expression) for name, expression in named.items()}
        pushed = notebook.execute(f"%taas push {','.join(named)}")
        if any(unpicklable(expression) for expression in expressions):
            assert pushed.error is not None and pushed.error["ename"] == "TaasUsageError", pushed.error
            assert "\n" not in pushed.error["evalue"] and "the cell needs 'p" in pushed.error["evalue"]
            return
        pushed.ok()
        pulled = notebook.execute(f"%taas pull {' '.join(named)}").ok()
        assert pulled.stderr == ""
        for name, kind in kinds.items():
            assert notebook.value(f"(type({name}).__name__, {name}.ranks, [type(v).__name__ for v in {name}])") == (
                "PerRank",
                (0, 1),
                [kind, kind],
            ), (name, named[name])
            assert isinstance(notebook.value(f"len(repr({name}))"), int)

    try:
        round_trip()
    finally:
        notebook.execute("%taas stop")
