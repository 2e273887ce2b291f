"""Shipping names by value, without a kernel: one pickle, tensor data in one memory file."""

from __future__ import annotations

import pickle

import pytest
import torch

from taas_magic import shipping


def test_names_and_tensors_arrive_with_the_tensors_data_in_one_memory_file() -> None:
    namespace = {"__name__": "__main__", "weights": torch.arange(6.0).reshape(2, 3),
                 "bias": torch.nn.Parameter(torch.ones(4)), "scale": 3}
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
        with pytest.raises(RuntimeError, match="only be unpickled by shipping.unpack"):
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


@pytest.mark.parametrize("value, fragment", [
    (_ExitsOnReduce(), "the cell needs 'x' (a test_shipping._ExitsOnReduce), which cannot be sent to ranks started "
                       "with --start forkserver (SystemExit: 3): create it inside the cell"),
    (_RaisesUnprintable(), "(_Unprintable): create it inside the cell"),
    (_PicklesOnce(), "the names the cell needs cannot be sent to ranks started with --start forkserver together "
                     "(ValueError: second time), though each can alone"),
])
def test_whatever_pickling_a_name_raises_is_one_line(value, fragment) -> None:
    from taas_magic.errors import TaasUsageError

    with pytest.raises(TaasUsageError) as raised:
        shipping.pack({"x": value}, ["x"])
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
