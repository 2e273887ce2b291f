"""What a notebook imports inside and outside taas cells: where am I in the job?

    import taas
    taas.rank(), taas.local_rank(), taas.world_size(), taas.is_main(), taas.device()

Inside a taas cell's ranks these read the environment the launch set; in the kernel they
answer as rank 0 of a job of 1, so the same code runs in both places.

    taas.register(loader), taas.unregister(loader), taas.registered()

mark DataLoaders that taas cells serve from separate CPU prefetch workers.

    taas.progress(step=i, loss=loss)

shows a rank's step, its rate and its metrics in the cell while the run goes on.

    taas.PerRank

is what a name brought back from several ranks is (``--return x --from all``, ``%taas pull x``).
"""

from __future__ import annotations

import os
from typing import Any

from taas_magic.per_rank import PerRank

from .registry import register, registered, unregister

__all__ = [
    "PerRank",
    "device",
    "is_main",
    "local_rank",
    "local_world_size",
    "progress",
    "rank",
    "register",
    "registered",
    "unregister",
    "world_size",
]

PerRank.__module__ = __name__  # shown and pickled as taas.PerRank, where users meet it


def rank() -> int:
    """This process's rank in the whole job (0 in the kernel)."""
    return _int("RANK", 0)


def local_rank() -> int:
    """This process's rank on its node: the index of its GPU (0 in the kernel)."""
    return _int("LOCAL_RANK", 0)


def world_size() -> int:
    """Number of ranks in the job (1 in the kernel)."""
    return _int("WORLD_SIZE", 1)


def local_world_size() -> int:
    """Number of ranks on this node (1 in the kernel)."""
    return _int("LOCAL_WORLD_SIZE", 1)


def is_main() -> bool:
    """True in rank 0, the one rank that writes to the project folder (and in the kernel)."""
    return rank() == 0


def device() -> Any:
    """The rank's ``torch.device``: its own GPU on CUDA runs, the CPU otherwise.

    In the kernel: the first GPU if one is visible, else the CPU. It asks NVML, not
    ``torch.cuda.is_available()``, which would keep later taas cells from forking GPU ranks.
    """
    import torch

    chosen = os.environ.get("TAAS_DEVICE", "").strip().lower()
    if "TAAS_RUN_ID" in os.environ:  # inside a rank: the launch resolved the device
        return torch.device("cuda", local_rank()) if chosen == "cuda" else torch.device("cpu")
    from taas_magic.process.machine import cuda_device_count

    if chosen == "cpu" or cuda_device_count() == 0:
        return torch.device("cpu")
    return torch.device("cuda", 0)


def progress(step: int | None = None, **metrics: Any) -> None:
    """Show this rank's ``step`` and ``metrics`` (numbers, or one-element tensors) in the cell:
    one line per rank, updated in place, with the steps per second. Call it as often as you
    like (every step): a rank sends at most four updates a second. Does nothing in the kernel."""
    from taas_magic.rank import progress as reports

    reports.note(step, metrics)


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise RuntimeError(f"{name}={value!r} in the environment is not a whole number") from None
