"""One element across processes through a memory file, as producers send it and ranks receive it."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from support.descriptors import open_descriptors, opened_since
from support.notebook_values import TENSORS, TORCH_WARNINGS_OF_TENSORS, same_tensor, tensor

from taas_magic.delivery import transport

pytestmark = TORCH_WARNINGS_OF_TENSORS


def roundtrip(element):
    producers_end, rank_end = transport.channel_pair()
    try:
        transport.send(producers_end, 3, 7, element)
        return transport.receive(rank_end)
    finally:
        producers_end.close()
        rank_end.close()


def test_tensors_and_structures_arrive_equal_and_writable():
    element = {
        "x": torch.randn(4, 3, 8, 8),
        "y": torch.arange(4),
        "ids": ["a", "b"],
        "empty": torch.zeros(0, 5),
        "view": torch.arange(20.0).reshape(4, 5)[:, 1:3],
        "half": torch.ones(3, dtype=torch.float16),
    }
    pass_number, index, got = roundtrip(element)
    assert (pass_number, index) == (3, 7)
    for key in ("x", "y", "empty", "view", "half"):
        assert torch.equal(got[key], element[key]) and got[key].dtype == element[key].dtype
    assert got["ids"] == ["a", "b"]
    got["x"].add_(1)  # the rank's copy is its own
    assert not torch.equal(got["x"], element["x"])


def test_from_another_process_and_nothing_stays_open():
    producers_end, rank_end = transport.channel_pair()
    fds_before = open_descriptors()
    pid = os.fork()
    if pid == 0:
        try:
            rank_end.close()
            for i in range(20):
                transport.send(producers_end, 0, i, (torch.full((1000,), float(i)), i))
        finally:
            os._exit(0)
    received = [transport.receive(rank_end) for _ in range(20)]
    os.waitpid(pid, 0)
    assert [index for _, index, _ in received] == list(range(20))
    assert all(float(element[0][0]) == index for _, index, element in received)
    del received
    assert opened_since(fds_before) == set()
    producers_end.close()
    rank_end.close()


def test_elements_a_rank_keeps_hold_no_descriptors_small_or_large():
    producers_end, rank_end = transport.channel_pair()
    small = {"x": torch.arange(16), "y": "label"}
    large = torch.arange(100_000, dtype=torch.float64)  # 800 KB: mapped, not read
    try:
        fds_before = open_descriptors()
        kept = []
        for i in range(200):
            transport.send(producers_end, 0, i, small if i % 2 else large)
            kept.append(transport.receive(rank_end)[2])
        assert opened_since(fds_before) == set(), "every kept element would hold one"
        assert all(torch.equal(element["x"], small["x"]) for element in kept[1::2])
        assert all(torch.equal(element, large) for element in kept[::2])
        kept[0].zero_()
        assert torch.equal(kept[2], large), "each mapping is private to its element"
    finally:
        producers_end.close()
        rank_end.close()


def test_what_waits_on_a_channel_is_discarded_without_blocking_or_keeping_descriptors():
    producers_end, rank_end = transport.channel_pair()
    try:
        assert transport.discard_waiting(rank_end) == 0, "nothing waiting: returns at once"
        for i in range(5):
            transport.send(producers_end, 0, i, torch.ones(3))
        fds_before = open_descriptors()
        assert transport.discard_waiting(rank_end) == 5
        assert opened_since(fds_before) == set()
        transport.send(producers_end, 0, 5, torch.ones(3))
        assert transport.receive(rank_end)[1] == 5, "the channel still works"
        producers_end.close()
        assert transport.discard_waiting(rank_end) == 0, "a closed channel ends the discarding"
    finally:
        producers_end.close()
        rank_end.close()


@pytest.mark.parametrize("kind", sorted(TENSORS))
def test_a_batch_tensor_that_is_more_than_its_elements_arrives_as_it_was(kind):
    """What a collate_fn may build: quantized or sparse batches, lazy conjugates, tensors with attributes."""
    sent = tensor(kind)
    _, _, got = roundtrip({"ahead": torch.arange(20_000), "value": sent})
    assert same_tensor(sent, got["value"]), (sent, got["value"])


def test_a_sparse_batch_is_the_ranks_alone_and_freed_when_dropped():
    """torch keeps each sparse tensor pickle rebuilds until its next ``torch.load``
    (``wire/sparse_rebuilds.py``): a rank that drops a sparse batch lets it go, pass after pass."""
    sent = {"x": torch.eye(4).to_sparse(), "y": torch.arange(4)}
    _, _, got = roundtrip(sent)
    assert torch.equal(got["x"].to_dense(), sent["x"].to_dense())
    assert torch._utils._sparse_tensors_to_validate == []
    alive = weakref.ref(got["x"])
    del got
    gc.collect()
    assert alive() is None
