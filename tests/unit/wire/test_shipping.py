"""Shipping names by value, without a kernel: one pickle, tensor data in one memory file."""

from __future__ import annotations

import pickle
from unittest.mock import MagicMock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.notebook_values import TENSORS, TORCH_WARNINGS_OF_TENSORS, same_tensor, tensor

from taas_magic.wire import shipping

pytestmark = TORCH_WARNINGS_OF_TENSORS


def test_names_and_tensors_arrive_with_the_tensors_data_in_one_memory_file() -> None:
    namespace = {
        "__name__": "__main__",
        "weights": torch.arange(6.0).reshape(2, 3),
        "bias": torch.nn.Parameter(torch.ones(4)),
        "scale": 3,
    }
    shipment = shipping.pack(namespace, ["weights", "bias", "scale"])
    try:
        assert shipment.tensors_fd is not None and shipment.tensors_size >= 10 * 4
        assert len(shipment.data) < 2000, "tensor data goes through the memory file, not the pickle"
        back = shipping.unpack(shipment.data, shipment.tensors_fd, shipment.tensors_size)
    finally:
        shipment.close()
    assert torch.equal(back["weights"], namespace["weights"]) and back["scale"] == 3
    assert isinstance(back["bias"], torch.nn.Parameter) and back["bias"].requires_grad


def test_a_shipped_tensor_outside_unpack_is_a_clear_error() -> None:
    shipment = shipping.pack({"__name__": "__main__", "weights": torch.ones(3)}, ["weights"])
    try:
        with pytest.raises(
            pickle.UnpicklingError, match="only be unpickled by taas, with the file its elements came in"
        ):
            pickle.loads(shipment.data)
    finally:
        shipment.close()


def test_an_augmented_assignment_reads_its_target_before_binding_it():
    import ast

    from taas_magic.cell_names import names_read

    assert {"total", "step"} <= names_read(ast.parse("total += step\nfresh = 1"))
    assert "fresh" not in names_read(ast.parse("total += step\nfresh = 1"))


class _ExitsOnReduce:
    def __reduce__(self):
        raise SystemExit(3)


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("str fails")


class _RaisesUnprintable:
    def __reduce__(self):
        raise _Unprintable()


class _PicklesOnce:
    """Pickles the first time only: the check of each name alone passes, the shipment fails."""

    def __init__(self):
        self.calls = 0

    def __reduce__(self):
        self.calls += 1
        if self.calls > 1:
            raise ValueError("second time")
        return (_PicklesOnce, ())


@pytest.mark.parametrize(
    "value, fragment",
    [
        (
            _ExitsOnReduce(),
            "the cell needs 'x' (a test_shipping._ExitsOnReduce), which cannot be sent to ranks started "
            "with --start forkserver (SystemExit: 3): create it inside the cell",
        ),
        (_RaisesUnprintable(), "(_Unprintable): create it inside the cell"),
        (
            _PicklesOnce(),
            "the names the cell needs cannot be sent to ranks started with --start forkserver together "
            "(ValueError: second time), though each can alone",
        ),
    ],
)
def test_whatever_pickling_a_name_raises_is_one_line(value, fragment) -> None:
    from taas_magic.errors import TaasUsageError

    with pytest.raises(TaasUsageError) as raised:
        shipping.pack({"x": value}, ["x"])
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


# -- a session's view of the notebook's values --------------------------------------------------
class _BadEq:
    def __eq__(self, other):
        raise RuntimeError("no comparing")

    __hash__ = object.__hash__


class _Anything:
    def __getattr__(self, name):
        return 42


_plain_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True),
        st.complex_numbers(allow_nan=True),
        st.text(max_size=5000),
        st.binary(max_size=5000),
        st.just(Ellipsis),
        st.just(NotImplemented),
        st.builds(_BadEq),
        st.builds(_Anything),
        st.builds(MagicMock),
        st.just(torch.tensor(float("nan"))),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(_plain_values)
@settings(max_examples=300, deadline=None)
def test_a_fingerprint_of_any_value_equals_itself_and_never_asks_the_value(value) -> None:
    assert shipping.fingerprint(value) == shipping.fingerprint(value)


@given(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(), st.binary()))
def test_a_number_or_string_is_fingerprinted_by_value(value) -> None:
    copy = pickle.loads(pickle.dumps(value))
    assert shipping.fingerprint(copy) == shipping.fingerprint(value)
    assert shipping.fingerprint([copy]) != shipping.fingerprint([value]), "a new container is a new value"


@pytest.mark.parametrize(
    "make",
    [lambda i: _Anything(), lambda i: torch.zeros(1), lambda i: float(str(i) + ".5")],
    ids=["object", "tensor", "float"],
)
def test_a_new_object_in_a_freed_ones_place_has_another_fingerprint(make) -> None:
    old = make(0)
    address, known = id(old), shipping.fingerprint(old)
    del old
    kept = []
    for i in range(1, 100000):
        new = make(i)
        if id(new) == address:
            break
        kept.append(new)
    assert id(new) == address, "the freed address must be reused for the test to mean anything"
    assert shipping.fingerprint(new) != known


def test_a_value_that_takes_no_weak_reference_is_kept_until_the_notebook_lets_go_of_it() -> None:
    value = {"i": 0}
    known = shipping.fingerprint(value)
    assert not known.keeps_other_than(value) and known == shipping.fingerprint(value)
    assert known.keeps_other_than({"i": 0}), "a session forgets it once the name is bound to another"
    assert known != shipping.fingerprint({"i": 0}), "the same items in a new dict are a new value"


def test_none_and_every_atom_reach_a_sessions_ranks_as_themselves() -> None:
    """The notebook's globals are referred to, not copied, for a session's ranks: a value is checked
    against cloudpickle's table of such globals, whose miss must match no value (None least of all)."""
    notebook = {"__name__": "__main__", "x": None, "y": 0, "z": float("nan")}
    shipment = shipping.pack_for_session(notebook, ["x", "y", "z"], lambda name, value: False)
    rank = {"__name__": "__main__", "mine": 1}
    shipping.unpack_into(rank, shipment.data, shipment.tensors_fd, shipment.tensors_size)
    assert rank["x"] is None and rank["y"] == 0 and rank["z"] != rank["z"] and rank["mine"] == 1


def test_a_notebook_function_sent_to_a_session_reads_the_ranks_own_value_of_a_name_they_hold() -> None:
    """What cloudpickle's ``_dynamic_function_reduce`` builds, taas extends: a held global goes as a reference
    to the ranks' value, a name they lack goes by value, and the function shares the ranks' namespace."""
    notebook: dict = {"__name__": "__main__", "weights": torch.ones(3), "scale": 2.0}
    exec("def total():\n    return float(weights.sum()) * scale", notebook)
    shipment = shipping.pack_for_session(notebook, ["total"], lambda name, value: name == "weights")
    rank = {"__name__": "__main__", "weights": torch.full((3,), 5.0)}
    shipping.unpack_into(rank, shipment.data, shipment.tensors_fd, shipment.tensors_size)
    assert rank["total"]() == 30.0 and rank["scale"] == 2.0
    rank["weights"] = torch.zeros(3)
    assert rank["total"]() == 0.0, "the function reads the ranks' namespace, not a copy of it"


def test_a_notebook_value_reached_through_another_is_bound_in_the_ranks_under_its_name() -> None:
    """The kernel counts a value that went as part of another (an object's class) as sent: the
    ranks hold it under its notebook name too, and a later cell may refer to it there."""
    namespace: dict = {"__name__": "__main__"}
    exec("class Box:\n    pass\nbox = Box()\nbox.weights = weights", namespace | {"weights": torch.ones(2)}, namespace)
    namespace["weights"] = namespace["box"].weights
    shipment = shipping.pack(namespace, ["box"], track=True)
    try:
        assert {"Box", "weights"} <= shipment.sent
        back = shipping.unpack(shipment.data, shipment.tensors_fd, shipment.tensors_size)
    finally:
        shipment.close()
    assert type(back["box"]) is back["Box"] and back["box"].weights is back["weights"]
    assert shipment.tensors_size == 8, "each tensor's data goes once"


def test_the_names_a_cell_reaches_are_found_without_asking_any_value_for_an_attribute() -> None:
    """Only functions, methods, partials and classes are looked into, by their type: a mock, or an
    object that raises from every attribute, is a value like any other."""
    import functools

    from taas_magic.cell_names import names_reached

    class Raising:
        def __getattr__(self, name):
            raise RuntimeError(f"asked for {name}")

    namespace: dict = {"__name__": "__main__", "mock": MagicMock(), "raising": Raising(), "scale": 2, "unused": 3}
    exec("def f(x):\n    return x * scale\n", namespace)
    namespace["step"] = functools.partial(namespace["f"], 1)
    assert names_reached({"mock", "raising", "step"}, namespace) == {"mock", "raising", "step", "scale"}


def shipped(namespace: dict, names: list[str]) -> dict:
    shipment = shipping.pack({"__name__": "__main__", **namespace}, names)
    try:
        return shipping.unpack(shipment.data, shipment.tensors_fd, shipment.tensors_size)
    finally:
        shipment.close()


@settings(max_examples=25, deadline=None)
@given(before=st.sampled_from([0, 7, 1000, 40_000]), seed=st.integers(0, 2**63 - 1), drawn=st.integers(0, 3))
def test_a_generator_shipped_after_other_tensors_draws_on_as_the_notebooks_would(before, seed, drawn) -> None:
    """A generator's state is a tensor; behind other tensors it lies inside the memory file, small or mapped
    (``before`` elements of 8 bytes ahead of it). ``Generator.set_state`` reads a tensor's storage from its
    start: the state read from the file's start was refused ("Invalid mt19937 state"), or crashed the
    process that unpickled it."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(drawn):
        torch.randperm(5, generator=generator)
    back = shipped({"ahead": torch.arange(before), "generator": generator}, ["ahead", "generator"])
    assert torch.equal(back["ahead"], torch.arange(before))
    assert torch.equal(back["generator"].get_state(), generator.get_state())
    assert torch.randperm(50, generator=back["generator"]).tolist() == torch.randperm(50, generator=generator).tolist()


def test_a_seeded_loader_over_tensors_shuffles_in_the_ranks_as_in_the_notebook() -> None:
    """The cluster example's loader: a dataset of tensors, then the loader's own generator."""
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(
        TensorDataset(torch.arange(3000.0).reshape(1000, 3)),
        batch_size=64,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )
    back = shipped({"loader": loader}, ["loader"])["loader"]
    assert [batch[0].tolist() for batch in back] == [batch[0].tolist() for batch in loader]


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 30_000), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.int8, torch.bool, torch.bfloat16]),
)
def test_each_shipped_tensor_has_a_storage_of_its_own_bytes_so_saving_it_writes_no_more(sizes, dtype) -> None:
    tensors = {f"t{i}": torch.arange(size).to(dtype) for i, size in enumerate(sizes)}
    back = shipped(tensors, sorted(tensors))
    for name, sent in tensors.items():
        assert torch.equal(back[name], sent) and back[name].dtype == dtype
        assert back[name].untyped_storage().nbytes() == sent.numel() * sent.element_size()
        assert back[name].storage_offset() == 0
    back["t0"].add_(1) if dtype != torch.bool else back["t0"].logical_not_()
    assert all(torch.equal(back[name], tensors[name]) for name in tensors if name != "t0"), "each its own bytes"


@pytest.mark.parametrize("kind", sorted(TENSORS))
@pytest.mark.parametrize("ahead", [0, 20_000], ids=["alone", "behind_others"])
def test_a_tensor_that_is_more_than_its_elements_arrives_as_it_was(kind, ahead) -> None:
    """Quantized, sparse, data-less or annotated tensors go through torch's own pickling; lazy conjugates
    and negations arrive as the elements they show. Before: a quantized tensor arrived without its scale
    (unusable in the rank), an annotated one without its attribute, and a conjugate, a negation or a meta
    tensor failed the cell with torch's error from inside taas."""
    sent = tensor(kind)
    back = shipped({"ahead": torch.arange(ahead), "value": sent}, ["ahead", "value"])
    assert same_tensor(sent, back["value"]), (sent, back["value"])
