"""The stream plan: who gets which element, checked against DistributedSampler's own rule."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DistributedSampler

from taas_magic.delivery.plan import StreamPlan


@pytest.mark.parametrize("length, world", [(1, 1), (1, 4), (7, 2), (10, 3), (12, 4), (5, 8), (100, 7)])
def test_each_pass_is_split_as_distributed_sampler_splits_a_dataset(length, world):
    plan = StreamPlan(length, world, units=length)
    (pass_,) = plan.passes()
    for rank in range(world):
        sampler = DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=False)
        assert plan.sequence(pass_, rank) == list(sampler)
        assert len(plan.sequence(pass_, rank)) == plan.share() == len(sampler)


@pytest.mark.parametrize("length, world, units", [(10, 3, 23), (10, 3, 30), (4, 4, 9), (6, 2, 1), (3, 5, 7)])
def test_units_cut_the_stream_and_every_element_reaches_its_places_exactly_once(length, world, units):
    plan = StreamPlan(length, world, units)
    passes = list(plan.passes())
    assert sum(p.real for p in passes) == units
    for pass_ in passes:
        sequences = [plan.sequence(pass_, rank) for rank in range(world)]
        assert len({len(s) for s in sequences}) == 1, "every rank gets as many elements as the others"
        delivered = sorted(itertools.chain(*sequences))
        assert set(delivered) == set(range(pass_.real))
        assert len(delivered) - pass_.real < world, "padding adds less than one round"
        places = {
            (rank, pass_.first_round + slot): index
            for rank, seq in enumerate(sequences)
            for slot, index in enumerate(seq)
        }
        sent = {place: index for index in range(pass_.real) for place in plan.destinations(pass_, index)}
        assert sent == places, "what producers send is exactly what ranks expect, round by round"


def test_an_endless_stream_when_no_units_are_given():
    plan = StreamPlan(5, 2, None)
    passes = list(itertools.islice(plan.passes(), 4))
    assert [p.number for p in passes] == [0, 1, 2, 3]
    assert [p.first_round for p in passes] == [0, 3, 6, 9]


def test_bad_plans_are_refused():
    for args in [(0, 1, None), (3, 0, None), (3, 1, 0)]:
        with pytest.raises(ValueError):
            StreamPlan(*args)
