"""What the kernel sends every rank of a run: the cell's task, and the kernel's state a spawned rank takes on.

The kernel builds one ``RankTask`` per run; forked ranks inherit it, spawned ones (from the fork
server, on a cluster node) receive it pickled with the names the cell needs. What a rank does with
it is rank code (``rank.worker.run_rank``): this module only says what travels.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, Protocol

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


@dataclass(frozen=True)
class TorchSettings:
    """torch's process-wide settings, read in the kernel and applied in a spawned rank.

    A forked rank inherits what the notebook set with ``torch.use_deterministic_algorithms``,
    ``torch.backends.cudnn.*``, ``torch.set_default_dtype`` or the float32 matmul precision; ranks
    started from the fork server get them copied from the kernel. Reading and setting these flags
    never initializes CUDA.
    """

    tf32: tuple[tuple[str, object], ...]  # (attribute path under torch, value); absent where unreadable
    matmul_precision: str | None  # for set_float32_matmul_precision; None where unreadable
    flags: tuple[tuple[str, object], ...]
    deterministic: tuple[bool, bool]  # use_deterministic_algorithms(mode, warn_only=...)
    default_dtype: str  # its name in torch ("float64"): a dtype object in the pickle would make a cluster node's
    # agent, which passes the task on unread, import torch to unpickle it (about 2 s of CPU and 480 MB per agent)
    grad_enabled: bool = True  # torch.set_grad_enabled(False) in a cell of the notebook
    anomaly: tuple[bool, bool] = (False, True)  # set_detect_anomaly(mode, check_nan)
    print_options: tuple[tuple[str, object], ...] = ()  # torch.set_printoptions(...)

    @classmethod
    def of_this_process(cls) -> "TorchSettings":
        import torch

        return cls(
            tf32=_read_all(torch, _TF32_FLAGS),
            matmul_precision=_read(torch, "get_float32_matmul_precision", call=True),
            flags=_read_all(torch, _FLAGS),
            deterministic=(
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            ),
            default_dtype=str(torch.get_default_dtype()).removeprefix("torch."),
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
        if (enabled, warn_only) != (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ):
            # only when the notebook changed it: this call also sets up torch's compiler caches
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        dtype = getattr(torch, self.default_dtype)
        if dtype != torch.get_default_dtype():
            torch.set_default_dtype(dtype)
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


class NodeDeliveryEnds(Protocol):
    """A cluster node's share of the run's data delivery as it travels with the task
    (``delivery.cluster_ends.NodeEnds``): which of the descriptors that come last with the fork server's
    ``StartRun`` is what; the run's supervisor attaches it to them."""

    def fd_count(self) -> int: ...


@dataclass(frozen=True)
class KernelContext:
    """The kernel's process state that spawned ranks must see as forked ones do.

    The fork server takes on the environment, folder and ``sys.path`` (``apply``); torch's
    settings are applied in each rank, so the server itself stays as it started.
    """

    environ: dict[str, str]
    cwd: str
    sys_path: list[str]
    torch_settings: TorchSettings

    @classmethod
    def of_this_process(cls) -> "KernelContext":
        return cls(dict(os.environ), os.getcwd(), list(sys.path), TorchSettings.of_this_process())

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path


@dataclass(frozen=True)
class LoaderPlan:
    """What the cell asks of one registered loader (it travels to the fork server, and to a
    session's supervisor with a cell)."""

    name: str
    producers: int
    units: int | None
    prefetch: int | None
    fastest: bool
    seed: int  # the run's seed for per-sample seeding, taken in the kernel
    on_demand: bool = False  # a session's: producers build nothing until a rank first iterates the loader


@dataclass(frozen=True)
class Returns:
    """The names a cell sends back into the notebook, and the ranks that send them.

    Every rank that runs the cell looks at ``names``, sending or not: a sharded model among them is
    gathered whole by all the ranks it is sharded over (``rank/sharded.py``).
    """

    names: tuple[str, ...] = ()
    ranks: frozenset[int] = frozenset({0})  # the ranks whose values come back: rank 0 unless --from says others
    running: frozenset[int] | None = None  # the ranks that run the cell (a session's --ranks); None: every rank

    def sent_by(self, rank: int) -> bool:
        return rank in self.ranks


@dataclass(frozen=True)
class DebugLink:
    """How a rank joins the notebook's visual debugger for a cell (``rank/visual_debugging.py``).

    The kernel listens on ``port`` of the loopback address while a debugging client is attached. A
    rank proves itself with ``secret`` and its rank (``token``) and the kernel proves itself with
    ``secret``; the kernel then shows the rank's threads in its own debugging session.
    """

    port: int
    secret: str
    run: str  # which run the rank belongs to, as the kernel names it (a session, or a one-shot cell)
    ranks: frozenset[int] | None = None  # the ranks that take part (--debug-ranks); None: every rank
    eager: bool = False  # breakpoints are set: join as the cell starts; else at a ``breakpoint()`` only

    def takes_part(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def token(self, rank: int) -> str:
        return f"{self.secret}:{self.run}:{rank}"


@dataclass(frozen=True)
class CellOrder:
    """What the ranks do with one cell: the cell's own options, the one record of them that travels.

    The kernel makes it once per cell from the cell's options (``kernel/runner.py``); a one-shot run's
    ``RankTask`` and a session's ``SessionCell`` carry it unchanged, through a fork server or a cluster
    node's agent, and one function in the rank reads it (``rank/cell.py``, ``run_cell``). A new per-cell
    option is a field here, its value where the kernel makes the order, and its use in ``run_cell``.
    """

    code: CodeType | None  # None: a session's rank opens the post-mortem debugger at its last error instead
    returns: Returns = Returns()  # what comes back into the notebook, and from which ranks
    loaders: tuple[LoaderPlan, ...] = ()  # registered loaders the ranks serve from this cell on
    debugging: DebugLink | None = None  # the notebook's visual debugger is on: how the ranks join it
    profile: str | None = None  # --profile: the kernel's folder for the ranks' traces (rank/profiling.py)


@dataclass(frozen=True)
class RankTask:
    """What every rank of a run is given: its first (a one-shot run's only) cell, and how the run's ranks
    are set up: their device, the kernel's state a spawned rank takes on, a session's lifetime."""

    order: CellOrder
    device: str  # "cuda" or "cpu"
    threads: int  # intra-op threads on CPU
    # The notebook's cells by file name: (label, code), for tracebacks where the kernel's line cache
    # is not inherited: {".../ipykernel_1/2.py": ("Cell In[5]", "x = 1\n")}.
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)
    context: KernelContext | None = None  # spawned ranks: the kernel's environment, folder, sys.path, torch settings
    seed: int | None = None  # the run's base seed, drawn in the kernel; each rank derives its own (rank/state.py)
    delivery: NodeDeliveryEnds | None = None  # on a cluster node: its share of data delivery, set by its agent
    # On a cluster node: the agent's folder where its ranks write --profile traces, which it sends on to the
    # kernel's (``CellOrder.profile``); set by the agent. None: the ranks write into the kernel's folder.
    node_traces: str | None = None
    keep: bool = False  # a session: the ranks stay, running the cells they are sent (rank/session.py)
    # In place of a session's rank that died: it waits for the cell that heals it (rank/healing.py) instead of
    # running the first cell.
    joins: bool = False
    idle_limit: float | None = None  # a session ends after this many seconds without a cell
    debug: bool = False  # a rank whose cell raised stays, paused, for the debugger (``%taas debug``)
    track: bool = True  # the rank samples its activity for the hang watchdog (off with --hang-after 0)

    def traces_folder(self, order: CellOrder) -> str | None:
        """Where this machine's ranks write their traces of ``order``'s cell; None: it is not profiled."""
        if order.profile is None:
            return None
        return self.node_traces or order.profile
