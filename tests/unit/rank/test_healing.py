"""What a replaced rank is given (``rank/healing.py``): the names whose digests agree in every surviving rank. A
digest must be the same for the same value in another process, whatever that process did before, and differ when
the value does."""

from __future__ import annotations

import threading

import torch
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.rank import healing

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def _trained(seed: int, hooks: int) -> dict:
    """A model and its optimizer after a step, in a process that counted ``hooks`` hook handles first."""
    for _ in range(hooks):
        torch.nn.Linear(1, 1).register_forward_hook(lambda *args: None).remove()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "lr": 0.1, "scale": lambda x: 2 * x}


@given(value=VALUES)
def test_any_value_digests_alike_whenever_it_is_the_same(value):
    assert healing.digests({"x": value}) == healing.digests({"x": value})
    assert set(healing.digests({"x": value})) == {"x"}


@given(one=VALUES, other=VALUES)
def test_different_values_digest_differently(one, other):
    if healing.digests({"x": one}) == healing.digests({"x": other}):
        assert repr(one) == repr(other)


def test_a_model_and_its_optimizer_digest_alike_whatever_hooks_were_counted_before_them():
    """A replaced rank's peers made their models at other points of their processes' lives: the hooks a module holds
    are keyed by a number each process counts on its own."""
    first, second = healing.digests(_trained(0, 0)), healing.digests(_trained(0, 7))
    assert first == second and set(first) == {"model", "optimizer", "lr", "scale"}
    assert healing.digests(_trained(1, 0))["model"] != first["model"], "other weights, another digest"


def test_only_the_users_picklable_names_are_given():
    names = {"__name__": "__main__", "In": [], "_i3": "x = 1", "_7": 7, "_dh": [], "kept": 1, "lock": threading.Lock()}
    assert set(healing.digests(names)) == {"kept"}, "Python's, IPython's and what cannot be pickled are not"


def _notebook_class(body: int) -> type:
    """A class as a notebook cell defines it: of ``__main__``, pickled by value, with a method and a property."""
    source = f"class Net:\n    scale = {body}\n    def forward(self, x):\n        return x * {body}\n"
    source += "    @property\n    def twice(self):\n        return 2\n"
    space: dict = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), space)
    return space["Net"]


def _digest_in_a_child(names: dict) -> dict:
    """``digests(names)`` in a forked process: what another rank, forked from the same parent, says."""
    import json
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, json.dumps(healing.digests(names)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        found = json.loads(answer.read())
    os.waitpid(pid, 0)
    return found


def test_a_class_the_notebook_defined_digests_alike_in_every_rank_and_differs_when_redefined():
    """cloudpickle writes such a class with a number each process draws the first time it writes it: the digest
    must not depend on it, or a replaced rank would lack every class of the notebook's (a NameError later)."""
    net = _notebook_class(3)
    assert _digest_in_a_child({"Net": net}) == healing.digests({"Net": net}), "each process drew its own number"
    assert healing.digests({"Net": _notebook_class(4)}) != healing.digests({"Net": net})
