"""What a rank starts with besides its environment: its own random seeds, and torch's global settings.

Seeds. Each run draws one base seed from the kernel's torch generator (which advances it: a
re-run draws new numbers, and a notebook that seeded torch in its first cell replays the same
ones when run again from the top). Rank r seeds `random`, NumPy and torch from that base and r,
so ranks differ from one another, forked and spawned ranks alike. A cell that seeds itself gets
exactly what it asked for.

Settings. A forked rank inherits what the notebook set with ``torch.use_deterministic_algorithms``,
``torch.backends.cudnn.*``, ``torch.set_default_dtype`` or the float32 matmul precision; ranks
started from the fork server get them copied from the kernel. Reading and setting these flags
never initializes CUDA.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import random
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

# torch's process-wide settings as attribute paths under `torch`, in the order they are applied.
# TF32 first through the older flags, then the float32 matmul precision, then (torch >= 2.9) the
# per-backend precisions that supersede both, parents before children ("none": as the parent). In
# that order a rank's settings read back as the kernel's, even after the notebook mixed the two
# APIs (torch then refuses to read some of them back, in the kernel and in the rank alike).
_TF32_FLAGS = ("backends.cuda.matmul.allow_tf32", "backends.cudnn.allow_tf32")
_FLAGS = (
    "backends.fp32_precision",
    "backends.cuda.matmul.fp32_precision",
    "backends.cudnn.fp32_precision",
    "backends.cudnn.conv.fp32_precision",
    "backends.cudnn.rnn.fp32_precision",
    "backends.mkldnn.fp32_precision",
    "backends.mkldnn.matmul.fp32_precision",
    "backends.mkldnn.conv.fp32_precision",
    "backends.mkldnn.rnn.fp32_precision",
    "backends.cudnn.enabled",
    "backends.cudnn.benchmark",
    "backends.cudnn.deterministic",
    "backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
    "backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
)


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

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
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


@dataclass(frozen=True)
class TorchSettings:
    """torch's process-wide settings, read in the kernel and applied in a spawned rank."""

    tf32: tuple[tuple[str, Any], ...]  # (attribute path under torch, value); absent where unreadable
    matmul_precision: str | None  # for set_float32_matmul_precision; None where unreadable
    flags: tuple[tuple[str, Any], ...]
    deterministic: tuple[bool, bool]  # use_deterministic_algorithms(mode, warn_only=...)
    default_dtype: Any
    grad_enabled: bool = True  # torch.set_grad_enabled(False) in a cell of the notebook
    anomaly: tuple[bool, bool] = (False, True)  # set_detect_anomaly(mode, check_nan)
    print_options: tuple[tuple[str, Any], ...] = ()  # torch.set_printoptions(...)

    @classmethod
    def of_this_process(cls) -> "TorchSettings":
        import torch

        return cls(
            tf32=_read_all(torch, _TF32_FLAGS),
            matmul_precision=_read(torch, "get_float32_matmul_precision", call=True),
            flags=_read_all(torch, _FLAGS),
            deterministic=(torch.are_deterministic_algorithms_enabled(),
                           torch.is_deterministic_algorithms_warn_only_enabled()),
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
            anomaly=(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            print_options=tuple(vars(torch._tensor_str.PRINT_OPTS).items()),
        )

    def apply(self) -> None:
        import torch

        _write_all(torch, self.tf32)
        if self.matmul_precision is not None:
            torch.set_float32_matmul_precision(self.matmul_precision)
        _write_all(torch, self.flags)
        enabled, warn_only = self.deterministic
        if (enabled, warn_only) != (torch.are_deterministic_algorithms_enabled(),
                                    torch.is_deterministic_algorithms_warn_only_enabled()):
            # only when the notebook changed it: this call also sets up torch's compiler caches
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        if self.default_dtype != torch.get_default_dtype():
            torch.set_default_dtype(self.default_dtype)
        torch.set_grad_enabled(self.grad_enabled)
        if self.anomaly != (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()):
            torch.set_anomaly_enabled(*self.anomaly)
        if self.print_options:
            torch.set_printoptions(**dict(self.print_options))


def _resolve(root: Any, path: str) -> Any:
    for name in path.split(".") if path else ():
        root = getattr(root, name)
    return root


def _read_all(torch: Any, paths: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    return tuple((path, value) for path in paths if (value := _read(torch, path)) is not None)


def _write_all(torch: Any, values: tuple[tuple[str, Any], ...]) -> None:
    for path, value in values:
        owner, _, name = path.rpartition(".")
        try:
            setattr(_resolve(torch, owner), name, value)
        except Exception:
            pass  # a flag this torch build refuses here stays as it is


def _read(torch: Any, path: str, call: bool = False) -> Any:
    try:
        value = _resolve(torch, path)
        return value() if call else value
    except Exception:  # absent in this torch version, or unreadable after mixing TF32 APIs
        return None
