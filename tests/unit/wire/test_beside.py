"""Tensors beside the pickle, the one mechanism of every hop: whatever tensors a pickle holds come back equal, as
views of the file they came in; each read uses its own file, however reads nest or run at once; a pickle read
without its file, or with a file of the other kind, fails in one line."""

from __future__ import annotations

import io
import os
import pickle
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support.notebook_values import TORCH_WARNINGS_OF_TENSORS

from taas_magic.wire import beside, bulk, memfile, results

pytestmark = TORCH_WARNINGS_OF_TENSORS


class _Writer(pickle.Pickler):
    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.beside = beside.FileTensors()

    def reducer_override(self, obj):
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and memfile.carries(obj):
            return self.beside.reduce(obj, parameter=isinstance(obj, torch.nn.Parameter))
        return NotImplemented


def sent(value) -> tuple[bytes, object]:
    """``value`` pickled with its tensors in a memory file; (the pickle, the file's memory as a receiver maps it)."""
    buffer = io.BytesIO()
    writer = _Writer(buffer)
    writer.dump(value)
    fd = memfile.new_file("test-beside", max(writer.beside.size, 1))
    try:
        writer.beside.write(fd)
        return buffer.getvalue(), memfile.map_private(fd)
    finally:
        os.close(fd)


def received(data: bytes, memory) -> object:
    return beside.Unpickler(io.BytesIO(data), beside.FileReader(memory)).load()


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool]


@st.composite
def tensors(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    t = (torch.rand(shape) * 100).to(dtype)
    if draw(st.booleans()) and dtype.is_floating_point:
        return torch.nn.Parameter(t, requires_grad=draw(st.booleans()))
    if draw(st.booleans()) and dtype.is_floating_point:
        t.requires_grad_()
    return t


@given(st.lists(tensors(), max_size=5), st.sampled_from([None, "x", 3, (None,)]))
def test_whatever_tensors_a_pickle_holds_come_back_equal_as_views_of_their_file(values, other):
    data, memory = sent({"tensors": values, "other": other})
    back = received(data, memory)
    assert back["other"] == other
    assert len(back["tensors"]) == len(values)
    for got, want in zip(back["tensors"], values):
        assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
        assert got.requires_grad == want.requires_grad
        assert torch.equal(got.detach(), want.detach())
        if got.numel():
            start = memory.data_ptr()
            assert start <= got.data_ptr() < start + memory.numel(), "a view of the file, not a copy"


def test_a_read_inside_a_read_leaves_the_outer_one_its_own_file():
    """A read that starts while another is under way (a rank unpacking a cell while a batch arrives, a value
    whose rebuild reads another pickle) ends without taking the outer read's file with it."""
    inner = sent(torch.full((3,), 7.0))
    outer_data, outer_memory = sent([torch.ones(2), _ReadsOnRebuild(inner), torch.zeros(4)])
    first, nested, last = received(outer_data, outer_memory)
    assert torch.equal(first, torch.ones(2)) and torch.equal(last, torch.zeros(4))
    assert torch.equal(nested, torch.full((3,), 7.0))


class _ReadsOnRebuild:
    def __init__(self, pickled):
        self.pickled = pickled

    def __reduce__(self):
        return received, self.pickled


def test_reads_at_once_in_threads_each_see_their_own_file():
    pickles = [sent([torch.full((1000,), float(i))] * 20) for i in range(4)]
    start = threading.Barrier(4)
    failures: list[BaseException] = []

    def read(i: int) -> None:
        start.wait()
        try:
            for _ in range(50):
                assert all(torch.equal(t, torch.full((1000,), float(i))) for t in received(*pickles[i]))
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def test_a_pickle_read_without_its_file_or_with_one_of_the_other_kind_fails_in_one_line():
    data, memory = sent(torch.ones(2))
    with pytest.raises(pickle.UnpicklingError, match="only be unpickled by taas, with the file its elements came in"):
        pickle.loads(data)
    names, _ = results.dumps({"t": torch.ones(2)})
    rank_side = results.receive_bytes(names.to_bytes())
    with pytest.raises(pickle.UnpicklingError, match="_tensor was sent beside it in a file of another kind"):
        beside.Unpickler(io.BytesIO(rank_side.pickles), beside.FileReader(memory)).load()
    with pytest.raises(pickle.UnpicklingError, match="tensor_at was sent beside it in a file of another kind"):
        beside.Unpickler(io.BytesIO(data), bulk.Reader(rank_side.layout, rank_side.memory)).load()


@pytest.mark.parametrize("kind", [torch.Tensor, torch.nn.Parameter])
def test_a_copy_off_a_device_keeps_what_the_tensor_carries(kind):
    """Here on the CPU (``.cpu()`` copies nothing); the CUDA tier sends GPU tensors through each hop."""
    original = torch.arange(6.0).reshape(2, 3)[:, 1]
    t = torch.nn.Parameter(original.clone()) if kind is torch.nn.Parameter else original.requires_grad_()
    t.note = "kept"
    copy = beside.on_cpu(t)
    assert type(copy) is kind and copy.note == "kept" and copy.requires_grad
    assert torch.equal(copy, t.detach()) and copy.grad_fn is None
