"""Sparse tensors that cross between taas's processes are the receiver's alone: torch keeps none of them.

torch appends each sparse tensor pickle rebuilds to a list that only its next ``torch.load`` empties
(``wire/sparse_rebuilds.py`` says why): a returned or shipped sparse tensor stayed alive after its name was
dropped, and a later ``torch.load`` of a dense checkpoint warned about it.
"""

from __future__ import annotations

import gc
import pickle
import warnings
import weakref

import pytest
import torch
import torch._utils

from taas_magic.wire import results, shipping

pytestmark = [  # what torch says as it makes the sparse tensors sent here
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning"),
]

SPARSE = {
    "coo": lambda: torch.eye(3).to_sparse(),
    "csr": lambda: torch.eye(3).to_sparse_csr(),
    "uncoalesced": lambda: torch.sparse_coo_tensor([[0, 0], [1, 1]], [1.0, 2.0], (2, 2)),
}


def returned(value: torch.Tensor) -> torch.Tensor:
    packed, skipped = results.dumps({"value": value})
    assert not skipped
    names, lost = results.loads(packed.to_bytes())
    assert not lost
    return names["value"]


def shipped(value: torch.Tensor) -> torch.Tensor:
    shipment = shipping.pack({"__name__": "__main__", "value": value}, ["value"])
    try:
        return shipping.unpack(shipment.data, shipment.tensors_fd, shipment.tensors_size)["value"]
    finally:
        shipment.close()


@pytest.mark.parametrize("kind", sorted(SPARSE))
@pytest.mark.parametrize("carried", [returned, shipped], ids=["returned", "shipped"])
def test_a_sparse_tensor_that_crossed_is_freed_when_dropped_and_a_later_load_says_nothing(kind, carried, tmp_path):
    sent = SPARSE[kind]()
    got = carried(sent)
    assert got.layout == sent.layout and torch.equal(got.to_dense(), sent.to_dense())
    assert torch._utils._sparse_tensors_to_validate == []
    alive = weakref.ref(got)
    del got
    gc.collect()
    assert alive() is None, "torch let go of it"
    torch.save({"w": torch.ones(2)}, tmp_path / "dense.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Validating sparse tensor invariants" for a dense checkpoint
        torch.load(tmp_path / "dense.pt", weights_only=True)


def test_what_torch_kept_before_a_load_stays_for_torch_load_to_check():
    """Only a load's own sparse tensors are taken off: one that plain pickle rebuilt is still torch's."""
    theirs = pickle.loads(pickle.dumps(SPARSE["coo"]()))
    try:
        ours = returned(SPARSE["csr"]())
        kept = torch._utils._sparse_tensors_to_validate
        assert len(kept) == 1 and kept[0] is theirs and ours is not theirs
    finally:
        torch._utils._sparse_tensors_to_validate.clear()
