"""The launch spec: everything one run needs, built from options, configurations and the machine.

Built and validated once, before anything starts; nothing downstream re-reads options or the
environment. Errors name the bad value and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, NoReturn, Sequence

from taas_magic.configurations import Catalog, Configuration
from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header.option_values import count, rank_text, ranks_as_typed
from taas_magic.kernel.header.options import (
    CellOptions,
    Device,
    OldStart,
    Order,
    Output,
    Start,
    default_device,
)
from taas_magic.per_rank import span
from taas_magic.process import logs
from taas_magic.process.machine import Machine

LOOPBACK = "127.0.0.1"
MAX_CPU_RANKS = 256  # a typo like --gpus 2000 with --device cpu must not fork-bomb the machine


@dataclass(frozen=True)
class LaunchSpec:
    world_size: int
    nodes: int
    ranks_per_node: int
    device: Literal["cuda", "cpu"]  # auto is resolved here
    configuration: Configuration | None
    cpus: int | None  # data producers per registered loader; None: the default
    units: int | None
    output: Output
    timeout: float | None
    threads_per_rank: int  # intra-op threads on CPU, as torchrun would choose
    return_names: tuple[str, ...] | None = None  # None: every name the cell binds; (): nothing
    return_from: tuple[int, ...] = (0,)  # the ranks the names come back from (--from)
    start: Start = "auto"  # auto is resolved when the cell runs
    order: Order = "deterministic"  # how ranks take elements of registered loaders
    prefetch: int | None = None  # elements producers may prepare ahead; None: the default
    master_addr: str = LOOPBACK
    on_cluster: bool = False  # the connected Ray cluster runs it (multi-node allowed), not this machine
    max_restarts: int = 0  # runs started again after a rank failed, at most
    keep: bool = False  # start a session: the ranks stay for the cells that follow (session.py)
    idle_limit: float = 3600.0  # a session ends after this many seconds without a cell
    debug: bool = False  # a rank whose cell raised stays, paused, for `%taas debug`
    hang_after: float = 120.0  # seconds without progress before the cell says where each rank waits (0: never)
    debug_ranks: tuple[int, ...] | None = None  # the ranks in the notebook's visual debugger (None: every rank)
    log: str | None = None  # TAAS_LOG: the run's processes log at this level to a file of the run's (process/logs.py)
    profile: bool = False  # torch.profiler in every rank, the traces merged into one (kernel/running/profiling.py)

    def __post_init__(self) -> None:
        if self.world_size != self.nodes * self.ranks_per_node:
            raise ValueError(f"world_size {self.world_size} != {self.nodes} nodes x {self.ranks_per_node}")

    @property
    def show_rank_prefix(self) -> bool:
        return self.world_size > 1 and self.output == "all"

    @property
    def data_options_given(self) -> bool:
        return (
            self.cpus is not None
            or self.units is not None
            or self.prefetch is not None
            or self.order != "deterministic"
        )


def build(
    options: argparse.Namespace,
    catalog: Catalog,
    machine: Machine,
    environ: Mapping[str, str],
    connected: bool = False,
) -> LaunchSpec:
    """``connected``: a Ray cluster is connected, so runs go there unless ``--on local``."""
    return _built(CellOptions.of(options), catalog, machine, environ, connected)


def _built(
    options: CellOptions, catalog: Catalog, machine: Machine, environ: Mapping[str, str], connected: bool
) -> LaunchSpec:
    configuration = catalog.get(options.config) if options.config is not None else None
    on_cluster = _on_cluster(options.on, connected)
    alone = options.alone  # `#!NAME` alone on a cluster: one process on a node of NAME
    requested = options.device or default_device(environ)
    if alone and configuration is not None and not configuration.gpus:
        requested = "cpu"
    device = _device(requested, configuration)
    world_size = 1 if alone else options.gpus or (configuration.gpus if configuration and configuration.gpus else 1)
    if on_cluster:
        per_node = _cluster_ranks_per_node(world_size, configuration, catalog.max_nodes)
    else:
        per_node = _ranks_per_node(world_size, configuration, catalog.max_nodes, device)
        _check_machine(world_size, device, machine)
    return LaunchSpec(
        world_size=world_size,
        nodes=world_size // per_node,
        ranks_per_node=per_node,
        device=device,
        configuration=configuration,
        cpus=options.cpus,
        units=options.units,
        output=options.output or "all",
        timeout=options.timeout,
        threads_per_rank=_threads_per_rank(
            environ, machine.cpus if not on_cluster or configuration is None else configuration.cpus, per_node
        ),
        return_names=options.return_names,
        return_from=return_from(options.return_from, range(world_size), "the run"),
        start=_start(options.start or "auto"),
        order=options.order,
        prefetch=options.prefetch,
        on_cluster=on_cluster,
        max_restarts=options.max_restarts,
        hang_after=120.0 if options.hang_after is None else options.hang_after,
        debug_ranks=debug_ranks(options.debug_ranks, range(world_size), "the run"),
        log=log_level(environ),
        profile=options.profile,
        **_session_options(options),
    )


def resized(spec: LaunchSpec, world: int) -> LaunchSpec:
    """A session's ``spec`` as ``%taas resize WORLD`` makes it, on this machine's CPUs: at most what its
    configuration holds on one node, and ``MAX_CPU_RANKS``. A one-line error names what is allowed."""
    configuration = spec.configuration
    per_node = (configuration.gpus or configuration.cpus) if configuration is not None else 0
    high = min(per_node or MAX_CPU_RANKS, MAX_CPU_RANKS)
    if not 1 <= world <= high:
        of = f" (its configuration {configuration.name} has {per_node} per node)" if configuration and per_node else ""
        raise TaasUsageError(f"%taas resize {world}: the session can have 1 to {high} ranks{of}")
    return _with_ranks(spec, world, 1)


def resized_on_nodes(spec: LaunchSpec, world: int) -> LaunchSpec:
    """A cluster session's ``spec`` as ``%taas resize WORLD`` makes it: whole nodes of as many ranks as before. A
    one-line error names what is allowed."""
    per_node = spec.ranks_per_node
    if world < per_node or world % per_node:
        raise TaasUsageError(
            f"%taas resize {world}: a session on the cluster has whole nodes of {per_node} ranks: "
            f"{', '.join(str(per_node * nodes) for nodes in range(1, 4))}, …"
        )
    return without_last_nodes(spec, world)


def without_last_nodes(spec: LaunchSpec, world: int) -> LaunchSpec:
    """A cluster session's ``spec`` once it lost its last nodes: ``world`` ranks, as many on each node as before."""
    return _with_ranks(spec, world, world // spec.ranks_per_node)


def _with_ranks(spec: LaunchSpec, world: int, nodes: int) -> LaunchSpec:
    return dataclasses.replace(
        spec,
        world_size=world,
        nodes=nodes,
        ranks_per_node=world // nodes,
        return_from=tuple(rank for rank in spec.return_from if rank < world) or (0,),
        debug_ranks=None if spec.debug_ranks is None else tuple(rank for rank in spec.debug_ranks if rank < world),
    )


def return_from(
    given: tuple[int, ...] | str | None, ranks: Sequence[int], where: str, option: str = "--from"
) -> tuple[int, ...]:
    """The ranks ``--from`` names, in order, among ``ranks`` (those that run the cell, in ``where``);
    rank 0 when it was left out. ``option``: the option the user typed them with, as errors name it."""
    if given is None:
        return (0,)
    if isinstance(given, str):  # --from all
        return tuple(ranks)
    outside = [rank for rank in given if rank not in ranks]
    if outside:
        raise TaasUsageError(
            f"{option} {ranks_as_typed(given)}: {where} has {span(ranks)}, not rank {rank_text(outside[0])}"
        )
    return tuple(sorted(given))


def log_level(environ: Mapping[str, str]) -> str | None:
    """``TAAS_LOG``: debug, info or warning; None (no log) when it is unset or empty."""
    value = environ.get(logs.LEVEL_VARIABLE, "").strip().lower()
    if value and value not in logs.LEVELS:
        raise TaasUsageError(f"TAAS_LOG={value!r} is not allowed: use {', '.join(logs.LEVELS)}, or leave it unset")
    return value or None


def debug_ranks(given: tuple[int, ...] | None, ranks: Sequence[int], where: str) -> tuple[int, ...] | None:
    """The ranks ``--debug-ranks`` names among ``ranks`` (``where`` has them); None, every rank, when left out."""
    return None if given is None else return_from(given, ranks, where, "--debug-ranks")


def _session_options(options: CellOptions) -> dict[str, Any]:
    keep, idle, debug = options.keep, options.idle, options.debug
    if idle is not None and not keep:
        raise TaasUsageError(f"--idle {idle:g} applies to a session: add --keep")
    if keep and debug:
        raise TaasUsageError(
            "--debug applies to one-shot cells: a session keeps a failing rank's error for %taas debug anyway"
        )
    if keep and options.max_restarts:
        raise TaasUsageError("--max-restarts applies to one-shot cells, not to a session (--keep)")
    return {"keep": keep, "idle_limit": 3600.0 if idle is None else idle, "debug": debug}


def _on_cluster(requested: str | None, connected: bool) -> bool:
    if requested == "cluster" and not connected:
        raise TaasUsageError("--on cluster: no cluster is connected: %taas cluster ADDRESS first (or set TAAS_CLUSTER)")
    return connected if requested is None else requested == "cluster"


def _cluster_ranks_per_node(world_size: int, configuration: Configuration | None, max_nodes: int) -> int:
    """Ranks on each node of a cluster run: a whole number of nodes of the configuration."""
    if configuration is None:
        raise TaasUsageError(
            "a run on the cluster needs a configuration: start the cell with #!NAME "
            "(for example #!g2.8), add --config NAME, or run it here with --on local"
        )
    per_node = configuration.gpus or configuration.cpus
    if min(world_size, per_node) > MAX_CPU_RANKS:
        raise TaasUsageError(
            f"--gpus {world_size} is too many ranks for one node of {configuration.name}: "
            f"at most {MAX_CPU_RANKS} per node"
        )
    if world_size <= per_node:
        return world_size
    _check_whole_nodes(world_size, configuration, per_node, max_nodes)
    return per_node


def _start(requested: Start | OldStart) -> Start:
    """``spawn``, the fork server's earlier name, is still accepted: it means ``forkserver``."""
    return "forkserver" if requested == "spawn" else requested


def _device(requested: Device, configuration: Configuration | None) -> Literal["cuda", "cpu"]:
    if configuration is not None and configuration.gpus == 0 and requested != "cpu":
        raise TaasUsageError(
            f"{configuration.name} has no GPUs: run its ranks on CPU with --device cpu, or pick a g configuration"
        )
    return "cuda" if requested == "auto" else requested


def _ranks_per_node(world_size: int, configuration: Configuration | None, max_nodes: int, device: str) -> int:
    """Ranks on each node; a run that needs more than one node is refused here: this is one node."""
    if configuration is not None:
        per_node = configuration.gpus or configuration.cpus
        if world_size > per_node:
            _refuse_nodes(world_size, configuration, per_node, max_nodes)
    if device == "cpu" and world_size > MAX_CPU_RANKS:  # whatever the configuration says
        raise TaasUsageError(f"--gpus {world_size} is too many CPU ranks for one machine: use 1-{MAX_CPU_RANKS}")
    return world_size


def _check_whole_nodes(world_size: int, configuration: Configuration, per_node: int, max_nodes: int) -> None:
    """More than one node's worth must be 2, 4, 8 or 16 nodes' worth (up to ``max_nodes``)."""
    node_counts = [n for n in (2, 4, 8, 16) if n <= max_nodes]
    if world_size % per_node or world_size // per_node not in node_counts:
        allowed = _one_of([_from_one_to(per_node)] + [str(per_node * n) for n in node_counts])
        unit = ("GPU" if configuration.gpus else "vCPU") + ("" if per_node == 1 else "s")
        raise TaasUsageError(
            f"--gpus {world_size} does not fit {configuration.name} ({per_node} {unit} per node): use {allowed}"
        )


def _refuse_nodes(world_size: int, configuration: Configuration, per_node: int, max_nodes: int) -> NoReturn:
    """More than one node's worth on this machine: a multi-node run (which needs a cluster) or a count
    that fits none."""
    _check_whole_nodes(world_size, configuration, per_node, max_nodes)
    raise TaasUsageError(
        f"--gpus {world_size} needs {world_size // per_node} nodes of {configuration.name}: multi-node runs "
        f"need a cluster (%taas cluster ADDRESS), and this machine is one node: use --gpus {_from_one_to(per_node)}"
    )


def _from_one_to(high: int) -> str:
    """``1-8``, or ``1`` where one is all there is (never ``1-1``)."""
    return "1" if high == 1 else f"1-{high}"


def _one_of(choices: list[str]) -> str:
    return choices[0] if len(choices) == 1 else ", ".join(choices[:-1]) + " or " + choices[-1]


def _check_machine(world_size: int, device: str, machine: Machine) -> None:
    if device != "cuda":
        return
    if machine.cuda_devices == 0:
        raise TaasUsageError(
            "no CUDA device is visible on this machine: run the ranks on CPU with --device cpu "
            "(or set TAAS_DEVICE=cpu before starting the kernel)"
        )
    if world_size > machine.cuda_devices:
        raise TaasUsageError(
            f"--gpus {world_size} needs {world_size} CUDA devices, this machine has {machine.cuda_devices}: "
            f"use --gpus {_from_one_to(machine.cuda_devices)}, or --device cpu"
        )


def _threads_per_rank(environ: Mapping[str, str], cpus: int, ranks_per_node: int) -> int:
    """Split the cores among the ranks (as torchrun does), unless the user chose OMP_NUM_THREADS."""
    chosen = environ.get("OMP_NUM_THREADS", "")
    if chosen.isdecimal() and int(chosen) > 0:  # isdigit() would accept "²", which int() refuses
        return int(chosen)
    return max(1, cpus // ranks_per_node)


def resolve_start(
    requested: Start | OldStart,
    device: str,
    fork_unsafe_for_cuda: bool,
    can_fork: bool,
    grpc_threads: bool = False,
    in_background: int = 0,
) -> tuple[Literal["fork", "forkserver"], str]:
    """The start method a run uses, and a one-line notice when ``auto`` did not pick fork.

    Forking is the fast path; it is refused for GPU ranks once the kernel has touched CUDA,
    where the fork server takes over. ``auto`` also leaves it to the fork server while gRPC runs
    threads in the kernel, which a fork would restart in every rank (``--start fork`` still forks).
    While ``in_background`` runs go on, their threads in the kernel hold locks at any moment (a run's
    store names each connection it accepts under glibc's resolver lock), which a forked process
    would inherit held and wait on for good: the ranks start from the fork server, and
    ``--start fork`` is refused.
    """
    if requested == "fork":
        if not can_fork:
            raise TaasUsageError("--start fork: this platform cannot fork processes; use --start forkserver")
        if in_background:
            verb = "has" if in_background == 1 else "have"
            raise TaasUsageError(
                f"--start fork: {count(in_background, 'run')} in the background {verb} threads in this kernel, "
                "which a fork would copy in the middle of what they do: use --start forkserver (or auto), "
                "or %taas wait first"
            )
        if device == "cuda" and fork_unsafe_for_cuda:
            raise TaasUsageError(
                "--start fork: CUDA was already used in this kernel (an earlier cell initialized it or asked "
                "torch.cuda.is_available()), and forked ranks cannot use CUDA after that: "
                "use --start forkserver (or auto)"
            )
        return "fork", ""
    if _start(requested) == "forkserver":
        return "forkserver", ""
    if not can_fork:
        return "forkserver", "taas: this platform cannot fork the kernel, so the ranks start from the fork server"
    if fork_unsafe_for_cuda:
        return "forkserver", (
            "taas: CUDA was already used in this kernel, so the ranks start from the fork server (--start forkserver)"
        )
    if in_background:
        return "forkserver", (
            "taas: a run in the background has threads in this kernel, which a fork would copy in the middle of "
            "what they do, so the ranks start from the fork server (--start forkserver)"
        )
    if grpc_threads:
        return "forkserver", (
            "taas: gRPC runs threads in this kernel (Ray Client, say), which a fork would copy into "
            "every rank, so the ranks start from the fork server (--start forkserver)"
        )
    return "fork", ""
