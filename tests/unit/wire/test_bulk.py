"""Tensors and NumPy arrays beside the pickle: the elements they show, their layout and what they share
come back; the memory they cover is written once; sparse views come back compact."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.notebook_values import TENSORS, TORCH_WARNINGS_OF_TENSORS, same_tensor, tensor

from taas_magic.wire import bulk, memfile, results

pytestmark = TORCH_WARNINGS_OF_TENSORS


def mapped(packed: results.Packed) -> results.Received:
    fd = memfile.new_file("test-names", packed.size)
    try:
        packed.write(fd)
        memfile.seal(fd)
        return results.receive_file(fd, packed.size)
    finally:
        os.close(fd)


CARRIED = {"mapped": mapped, "bytes": lambda packed: packed.to_bytes()}


def back(how: str, **values) -> tuple[dict, results.Packed]:
    packed, skipped = results.dumps(values)
    assert not skipped, skipped
    names, lost = results.loads(CARRIED[how](packed))
    assert not lost, lost
    return names, packed


@pytest.fixture(params=sorted(CARRIED))
def how(request) -> str:
    return request.param


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.uint8]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    permute=st.booleans(),
    step=st.integers(1, 3),
    carried=st.sampled_from(sorted(CARRIED)),
)
def test_any_strided_tensor_comes_back_with_its_elements_shape_and_dtype(dtype, shape, permute, step, carried):
    base = (torch.arange(int(np.prod(shape or [1])) * step * 2) % 7).to(dtype)
    tensor = base[::step][: int(np.prod(shape or [1]))].reshape(shape) if shape else base[0]
    if permute and tensor.dim() > 1:
        tensor = tensor.transpose(0, -1)
    names, _ = back(carried, tensor=tensor)
    got = names["tensor"]
    assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["float32", "int16", "complex64", "bool", "<U3", "uint64"]),
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=3),
    reverse=st.booleans(),
    fortran=st.booleans(),
    carried=st.sampled_from(sorted(CARRIED)),
)
def test_any_numpy_array_comes_back_equal_and_writable_as_it_was(dtype, shape, reverse, fortran, carried):
    array = np.asarray(np.arange(int(np.prod(shape))).reshape(shape), dtype=dtype, order="F" if fortran else "C")
    if reverse:
        array = array[::-1]
    names, _ = back(carried, array=array)
    got = names["array"]
    assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    assert got.flags.writeable
    if got.size:
        got.flat[0] = got.flat[-1]  # the notebook's own copy: writing it changes nothing of the rank's


def test_a_tensor_and_its_numpy_view_share_their_memory_in_the_notebook_too(how):
    tensor = torch.zeros(1000)
    names, packed = back(how, tensor=tensor, array=tensor.numpy(), view=tensor[10:20])
    names["array"][15] = 7.0
    assert names["tensor"][15] == 7.0 and names["view"][5] == 7.0
    assert packed.size < 4000 + 2000, "the memory they share is written once"


def test_a_small_view_comes_back_compact_unless_a_name_beside_it_shows_the_rest():
    big = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB
    alone, packed = back("mapped", head=big[:3], column=big.view(1000, 1000)[:, 7])
    assert packed.size < 20_000 and alone["column"].is_contiguous()
    assert torch.equal(alone["column"], big.view(1000, 1000)[:, 7]) and torch.equal(alone["head"], big[:3])
    together, packed = back("mapped", big=big, head=big[:3])
    together["big"][1] = -1.0
    assert together["head"][1] == -1.0, "the two share the storage in the notebook, as in the rank"
    assert packed.size < 4_000_000 + 10_000


def test_parameters_and_gradients_come_back_as_leaves_without_a_graph():
    weight = torch.nn.Parameter(torch.ones(3))
    out = weight * 2
    names, _ = back("mapped", weight=weight, out=out, plain=torch.ones(2))
    assert isinstance(names["weight"], torch.nn.Parameter) and names["weight"].requires_grad
    assert names["out"].is_leaf and names["out"].grad_fn is None and names["out"].requires_grad
    assert not names["plain"].requires_grad


def test_tensors_inside_objects_come_back_in_place_and_shared():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    names, _ = back("mapped", model=model, optimizer=optimizer, state={"w": model.weight})
    assert names["optimizer"].param_groups[0]["params"][0] is names["model"].weight
    assert names["state"]["w"] is names["model"].weight
    assert torch.equal(names["model"](torch.ones(4)), model(torch.ones(4)))


def test_what_is_not_plain_memory_goes_in_the_pickle_as_before():
    sparse = torch.eye(3).to_sparse()
    tagged = torch.ones(3)
    tagged.note = "kept"
    objects = np.array([1, "x", None], dtype=object)
    names, packed = back(
        "mapped", sparse=sparse, tagged=tagged, objects=objects, conj=torch.ones(2, dtype=torch.cfloat).conj()
    )
    assert torch.equal(names["sparse"].to_dense(), torch.eye(3))
    assert names["tagged"].note == "kept" and list(names["objects"]) == [1, "x", None]
    assert torch.equal(names["conj"].resolve_conj(), torch.ones(2, dtype=torch.cfloat))


def test_each_span_keeps_its_alignment_in_the_file():
    tensors = {f"t{i}": torch.ones(17 + i, dtype=torch.float64)[1:] for i in range(5)}
    packed, _ = results.dumps(tensors)
    for span in packed.spans:
        assert span.offset % bulk.ALIGN == span.start % bulk.ALIGN


def test_a_sealed_file_cannot_be_changed_by_the_rank_that_wrote_it():
    fd = memfile.new_file("test-sealed", 8)
    try:
        memfile.write_bytes(fd, b"12345678")
        assert memfile.sealed(fd) is False
        memfile.seal(fd)
        assert memfile.sealed(fd) is True
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4)
    finally:
        os.close(fd)


def test_unpickling_a_tensor_sent_beside_its_pickle_without_its_file_says_so():
    packed, _ = results.dumps({"t": torch.ones(2)})
    received = results.receive_bytes(packed.to_bytes())
    with pytest.raises(pickle.UnpicklingError, match="with the file its elements came in"):
        pickle.loads(received.pickles)
    assert packed.spans


def test_each_name_holds_only_the_memory_it_shared_in_the_rank_so_saving_it_writes_no_more():
    big, small = torch.ones(3_000_000), torch.arange(10.0)
    names, _ = back("mapped", big=big, small=small)
    assert names["small"].untyped_storage().nbytes() < 4096
    assert names["big"].untyped_storage().nbytes() < 12_000_000 + 4096
    assert torch.equal(names["small"], small) and torch.equal(names["big"], big)


def test_large_spans_are_mapped_without_keeping_a_descriptor_and_unmapped_when_their_tensors_go():
    def maps() -> int:
        with open("/proc/self/maps") as file:
            return sum(1 for _ in file)

    values = {f"t{i}": torch.full((1_000_000,), float(i)) for i in range(20)}  # 4 MB each: mapped
    packed, _ = results.dumps(values)
    descriptors, mappings = len(os.listdir("/proc/self/fd")), maps()
    names, _ = results.loads(mapped(packed))
    assert len(os.listdir("/proc/self/fd")) == descriptors
    assert maps() >= mappings + 20
    assert all(float(names[f"t{i}"][-1]) == i for i in range(20))
    del names
    assert maps() < mappings + 5, "every span's mapping went with its tensor"


def test_a_changed_returned_tensor_is_the_notebooks_own():
    source = torch.zeros(1_000_000)
    packed, _ = results.dumps({"t": source})
    names, _ = results.loads(mapped(packed))
    names["t"][0] = 3.0
    again, _ = results.loads(mapped(packed))
    assert float(again["t"][0]) == 0.0 and float(source[0]) == 0.0


@settings(max_examples=20, deadline=None)
@given(
    before=st.sampled_from([0, 7, 1000, 400_000]),
    seed=st.integers(0, 2**63 - 1),
    carried=st.sampled_from(sorted(CARRIED)),
)
def test_a_generator_beside_other_tensors_comes_back_drawing_as_the_ranks_would(before, seed, carried):
    """``Generator.set_state`` reads its state tensor from the storage's start (``shipping``'s tests say
    how that failed there): a generator that comes back must get its own state, wherever it lay."""
    generator = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(list(range(20)), batch_size=4, shuffle=True, generator=generator)
    names, _ = back(carried, ahead=torch.arange(before), loader=loader, same=[torch.ones(3), generator])
    assert names["loader"].generator is names["same"][1], "shared as in the rank"
    assert torch.equal(names["same"][1].get_state(), generator.get_state())
    assert [b.tolist() for b in names["loader"]] == [b.tolist() for b in loader]


@pytest.mark.parametrize("kind", sorted(TENSORS))
def test_a_tensor_that_is_more_than_its_elements_comes_back_as_it_was(kind, how):
    sent = tensor(kind)
    names, _ = back(how, ahead=torch.arange(20_000), value=sent)
    assert same_tensor(sent, names["value"]), (sent, names["value"])
