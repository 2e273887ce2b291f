"""Elements built again in a rank in place of one that died are the ones the producers built: same samples, same
random draws, whatever the shuffling, batching and number of producers."""

from __future__ import annotations

import random
from typing import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from taas_magic.delivery import transport
from taas_magic.delivery.counters import Counters
from taas_magic.delivery.plan import StreamPlan
from taas_magic.delivery.producer import ProducerTask, _random_state_kept, _seed_everything, rebuild


class Drawn(Dataset):
    """Element i: i, then a draw from torch's generator and one from ``random``, made as it is built."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.randint(0, 10**6, ()).item(), random.randrange(10**6)])


def produced(
    make_loader: Callable[[], DataLoader], plan: StreamPlan, producers: int, seed: int
) -> dict[tuple[int, int], torch.Tensor]:
    """Every element of the stream as ``producers`` producers build and send it, each with its own copy of the
    loader (a producer process's, forked), from the run's seed as a producer process starts (here one after
    another, in this process)."""
    counters = Counters(producers, plan.world)
    channels = [transport.channel_pair() for _ in range(plan.world)]
    elements: dict[tuple[int, int], torch.Tensor] = {}
    try:
        with _random_state_kept():
            for index in range(producers):
                task = ProducerTask(
                    "drawn",
                    make_loader(),
                    plan,
                    index,
                    producers,
                    10**6,
                    [ends[0] for ends in channels],
                    counters,
                    seed,
                    False,
                )
                _seed_everything(seed)
                task._produce()
                for _, ranks_end in channels:
                    while (arrived := transport.receive_if_waiting(ranks_end)) is not None:
                        pass_number, element, value = arrived
                        elements[(pass_number, element)] = value
    finally:
        for pair in channels:
            for end in pair:
                end.close()
    return elements


@settings(max_examples=25, deadline=None)
@given(
    samples=st.integers(3, 24),
    batch_size=st.sampled_from([None, 1, 3]),
    shuffle=st.booleans(),
    own_generator=st.booleans(),
    producers=st.integers(1, 3),
    world=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    picks=st.data(),
)
def test_rebuilt_elements_are_the_ones_the_producers_built(
    samples, batch_size, shuffle, own_generator, producers, world, seed, picks
):
    def make_loader() -> DataLoader:
        generator = torch.Generator().manual_seed(seed + 1) if own_generator else None
        return DataLoader(Drawn(samples), batch_size=batch_size, shuffle=shuffle, generator=generator)

    loader = make_loader()  # the rank's copy: as the producers' were before they drew from it
    plan = StreamPlan(len(loader), world, 3 * len(loader))  # three passes
    sent = produced(make_loader, plan, producers, seed)
    assert len(sent) == 3 * len(loader)
    lost = picks.draw(st.sets(st.sampled_from(sorted(sent)), min_size=1, max_size=8))
    before = torch.get_rng_state(), random.getstate()
    built = rebuild(loader, plan, seed, lost)
    assert (torch.get_rng_state().equal(before[0]), random.getstate() == before[1]) == (True, True), (
        "the rank's own random state is kept"
    )
    assert sorted(built) == sorted(lost)
    for key in lost:
        assert torch.equal(built[key], sent[key]), f"element {key}: {built[key].tolist()} != {sent[key].tolist()}"


def test_a_producer_with_worker_processes_builds_what_is_rebuilt_without_them():
    def make_loader() -> DataLoader:
        return DataLoader(Drawn(20), batch_size=2, shuffle=True, num_workers=2)

    loader = make_loader()
    plan = StreamPlan(len(loader), 2, 2 * len(loader))
    sent = produced(make_loader, plan, 2, 7)
    lost = {(0, 9), (1, 0), (1, 3)}
    built = rebuild(loader, plan, 7, lost)
    assert all(torch.equal(built[key], sent[key]) for key in lost)


def test_nothing_lost_builds_nothing():
    loader = DataLoader(Drawn(5))
    assert rebuild(loader, StreamPlan(5, 2, None), 0, set()) == {}
