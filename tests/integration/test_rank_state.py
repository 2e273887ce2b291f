"""What a rank starts with: seeds derived from the run's base seed, and the kernel's torch settings."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from typing import Callable

import pytest
import torch

from taas_magic.rank.state import RankSeeds, rank_seeds
from taas_magic.wire.task import TorchSettings


def test_rank_seeds_differ_per_rank_and_library_and_never_change() -> None:
    seeds = [rank_seeds(12345, rank) for rank in range(64)]
    values = [value for s in seeds for value in (s.torch, s.random, s.numpy)]
    assert len(set(values)) == len(values), "no two ranks or libraries share a seed"
    assert rank_seeds(12345, 3) == seeds[3], "a pure function of the base seed and the rank"
    assert rank_seeds(12346, 3) != seeds[3]
    assert all(0 <= s.numpy < 2**32 and 0 <= s.torch < 2**63 and 0 <= s.random < 2**63 for s in seeds)
    # Fixed: the same in forked and spawned ranks, on this machine and another, in this release and the next.
    assert rank_seeds(0, 0) == RankSeeds(torch=5352255284884154797, random=6087782115342167619, numpy=1767605303)


def test_numpy_is_seeded_when_the_cell_first_imports_numpy_random() -> None:
    """A rank does not import numpy.random itself (milliseconds per rank): it seeds it on import."""
    script = textwrap.dedent("""
        import sys, torch
        assert "numpy.random" not in sys.modules, "the test needs a process that has not imported it"
        from taas_magic.rank.state import rank_seeds, seed_rank
        seed_rank(12345, 3, "cpu")
        assert "numpy.random" not in sys.modules, "seeding imported numpy.random"
        import numpy.random
        drawn = numpy.random.rand(3).tolist()
        numpy.random.seed(rank_seeds(12345, 3).numpy)
        assert drawn == numpy.random.rand(3).tolist(), "seeded on import with the rank's own seed"
        assert not any(type(f).__name__ == "_AfterImport" for f in sys.meta_path), "the hook stepped aside"
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def in_a_child(work: Callable[[], object]) -> object:
    """``work()``'s result, computed in a forked child: the settings it makes stay there."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write_end, pickle.dumps(work()))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def settings_now() -> list:
    return [
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.get_default_dtype(),
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    ]


def changed() -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = True
    torch.set_default_dtype(torch.float64)
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = False


def tf32_flag() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True


@pytest.mark.parametrize("change", [changed, tf32_flag])
def test_torch_settings_read_in_one_process_hold_in_another(change: Callable[[], None]) -> None:
    """Read in the kernel, applied in a spawned rank: the rank reads back what the kernel would."""

    def capture() -> tuple[TorchSettings, list]:
        change()
        return TorchSettings.of_this_process(), settings_now()

    captured, expected = in_a_child(capture)
    assert expected != settings_now(), "the change is visible"

    def apply() -> tuple[list, bool]:
        captured.apply()
        return settings_now(), torch.cuda.is_initialized()

    assert in_a_child(apply) == (expected, False)
