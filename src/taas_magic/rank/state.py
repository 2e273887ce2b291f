"""What a rank starts with besides its environment: its own random seeds.

Seeds. Each run draws one base seed from the kernel's torch generator (which advances it: a
re-run draws new numbers, and a notebook that seeded torch in its first cell replays the same
ones when run again from the top). Rank r seeds `random`, NumPy and torch from that base and r,
so ranks differ from one another, forked and spawned ranks alike. A cell that seeds itself gets
exactly what it asked for.

torch's global settings, read in the kernel and applied in a spawned rank, travel in the task
(``wire.task.TorchSettings``).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import random
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Sequence


def draw_base_seed() -> int:
    """One draw from the kernel's default torch generator: the run's base seed (advances the generator)."""
    import torch

    return int(torch.empty((), dtype=torch.int64, device="cpu").random_().item())  # never the default device


@dataclass(frozen=True)
class RankSeeds:
    torch: int
    random: int
    numpy: int  # NumPy's legacy global generator takes 32 bits


def rank_seeds(base: int, rank: int) -> RankSeeds:
    """Rank ``rank``'s seeds: BLAKE2b of ``taas:<base>:<rank>:<library>``, one per library.

    Separate seeds per library keep torch's and NumPy's Mersenne Twisters (same algorithm) from
    producing the same stream; a hash spreads neighbouring bases and ranks far apart. Pure: the
    same in forked and spawned ranks, on any machine.
    """

    def derive(library: str, bits: int) -> int:
        digest = hashlib.blake2b(f"taas:{base}:{rank}:{library}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> (64 - bits)

    return RankSeeds(torch=derive("torch", 63), random=derive("random", 63), numpy=derive("numpy", 32))


def seed_rank(base: int, rank: int, device: str) -> None:
    """Seed this rank's `random`, NumPy and torch generators (NumPy's when the cell first imports `numpy.random`).

    On CUDA runs ``torch.manual_seed`` also seeds the GPUs' generators (lazily, when CUDA starts);
    on CPU runs only the CPU generator is seeded, which is all there is.
    """
    seeds = rank_seeds(base, rank)
    random.seed(seeds.random)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(seeds.numpy)
    else:  # importing it costs a rank milliseconds: seed it if and when the cell imports it
        sys.meta_path.insert(0, _AfterImport("numpy.random", lambda module: module.seed(seeds.numpy)))
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if device == "cuda":
        torch.manual_seed(seeds.torch)
    else:
        torch.default_generator.manual_seed(seeds.torch)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` once module ``name`` has been imported, the first time it is; then steps aside."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name = name
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load, then = spec.loader.exec_module, self.then

        def exec_module(module: ModuleType) -> None:
            load(module)
            then(module)

        setattr(spec.loader, "exec_module", exec_module)
        return spec
