"""The options of `%%taas` / `#pragma taas`, declared once for parsing and for `%%taas?` help.

Converters raise ``ArgumentTypeError`` with the value and what is allowed, so every bad option
ends as a one-line ``UsageError`` before anything starts.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Mapping, get_args

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.utils.process import arg_split  # type: ignore[attr-defined]  # re-exported by IPython

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header import line_commands
from taas_magic.kernel.header.option_values import (
    Ranks,
    names_or_none,
    rank_list,
    ranks_or_all,
    refuse_kernels_own,
    seconds,
    seconds_or_off,
    shortened,
    whole_number,
)

Device = Literal["auto", "cuda", "cpu"]
Start = Literal["auto", "fork", "forkserver"]
OldStart = Literal["spawn"]  # the fork server's earlier name: still accepted, no longer offered
Order = Literal["deterministic", "fastest"]
Output = Literal["all", "rank0"]
Place = Literal["local", "cluster"]
DEVICES: tuple[Device, ...] = get_args(Device)
STARTS: tuple[Start, ...] = get_args(Start)
OLD_STARTS: tuple[OldStart, ...] = get_args(OldStart)
ORDERS: tuple[Order, ...] = get_args(Order)
OUTPUTS: tuple[Output, ...] = get_args(Output)
PLACES: tuple[Place, ...] = get_args(Place)
MAX_CPUS = 8
MAX_RESTARTS = 100  # a typo like --max-restarts 1000 must not loop a crashing job for hours
MAX_LINE = 4096  # characters of options, after IPython expanded {expressions} and $names


def declare(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the magic with its options (the outermost decorator is listed first in help); its docstring,
    which `%taas?` shows above them, ends with the line magic's commands."""
    func.__doc__ = inspect.cleandoc(func.__doc__ or "") + "\n\n" + line_commands.table() + "\n"
    decorators = [
        magic_arguments.magic_arguments(),
        magic_arguments.argument_group("ranks and devices"),
        magic_arguments.argument(
            "--gpus",
            type=whole_number(1),
            default=None,
            metavar="N",
            help="number of ranks, one per GPU (default: the configuration's GPUs per node, else 1). "
            "More than one node's worth (g2.8: 16, 32) runs on the connected cluster.",
        ),
        magic_arguments.argument(
            "--config",
            default=None,
            metavar="NAME",
            help="machine configuration (g2.8, g1.4, c1.4, ...); `#!NAME` on the first line means the same.",
        ),
        magic_arguments.argument(
            "--device",
            choices=DEVICES,
            default=None,
            help="where ranks compute (default: $TAAS_DEVICE, else auto = CUDA, with an error where there is none).",
        ),
        magic_arguments.argument(
            "--start",
            choices=STARTS + OLD_STARTS,
            default=None,
            help="fork: ranks are forked from the kernel (fastest, shares its memory); forkserver: from a fork "
            "server that never touched CUDA, with what the cell needs shipped by value (spawn: the same, its "
            "earlier name); auto: fork unless CUDA was used in the kernel.",
        ),
        magic_arguments.argument(
            "--on",
            choices=PLACES,
            default=None,
            help="cluster: the ranks run on the connected Ray cluster (the default once connected, with "
            "%%taas cluster ADDRESS or $TAAS_CLUSTER); local: on this machine, connected or not.",
        ),
        magic_arguments.argument_group("data delivery (registered DataLoaders)"),
        magic_arguments.argument(
            "--cpus",
            type=whole_number(0, MAX_CPUS, " (0 turns data delivery off)"),
            default=None,
            metavar="K",
            help=f"CPU prefetch workers per registered DataLoader, 0-{MAX_CPUS}.",
        ),
        magic_arguments.argument(
            "--units",
            type=whole_number(1),
            default=None,
            metavar="U",
            help="elements to take from registered DataLoaders in total (default: as many as the ranks ask for).",
        ),
        magic_arguments.argument(
            "--order",
            choices=ORDERS,
            default="deterministic",
            help="deterministic: every rank gets the same elements in the same order on every run; "
            "fastest: a rank takes whichever of its elements is ready first.",
        ),
        magic_arguments.argument(
            "--prefetch",
            type=whole_number(1),
            default=None,
            metavar="N",
            help="elements a registered loader's producers may prepare ahead of the slowest rank "
            "(default: enough to keep every producer busy).",
        ),
        magic_arguments.argument_group("output and results"),
        magic_arguments.argument(
            "--output",
            choices=OUTPUTS,
            default=None,
            help="all: every rank's output, each line prefixed with its rank; rank0: rank 0's alone, unprefixed.",
        ),
        magic_arguments.argument(
            "--return",
            dest="return_names",
            type=names_or_none,
            default=None,
            metavar="NAMES",
            help="names rank 0 sends back into the notebook (default: every name the cell binds at top level); "
            "none: nothing comes back.",
        ),
        magic_arguments.argument(
            "--from",
            dest="return_from",
            type=ranks_or_all,
            default=None,
            metavar="RANKS",
            help="the ranks the names come back from (default 0): 3, 0,2, 0-3 or all. From several ranks, each "
            "name arrives as a taas.PerRank: x[rank] is that rank's value.",
        ),
        magic_arguments.argument(
            "--timeout",
            type=seconds,
            default=None,
            metavar="SECONDS",
            help="stop ranks still running after this many seconds and show where each one was.",
        ),
        magic_arguments.argument(
            "--hang-after",
            dest="hang_after",
            type=seconds_or_off,
            default=None,
            metavar="SECONDS",
            help="when no rank made progress for this many seconds, say which rank waits where and why, and let "
            "the run go on (default 120; 0: never).",
        ),
        magic_arguments.argument(
            "--profile",
            action="store_true",
            help="run torch.profiler in every rank for the whole cell (CPU, and CUDA on a GPU run; no stacks, "
            "shapes or memory: a few MB a second), merge the ranks' traces into one Chrome/Perfetto trace in the "
            "notebook's folder (taas-profile-DATE-TIME.json.gz, a row per rank, times aligned) and show a picture of "
            "where each rank's time went. On a cluster, each node's traces come back to this machine.",
        ),
        magic_arguments.argument_group("failures"),
        magic_arguments.argument(
            "--max-restarts",
            dest="max_restarts",
            type=whole_number(0, MAX_RESTARTS),
            default=0,
            metavar="N",
            help="when a rank fails, stop every rank and start the run again, up to N times, as torchrun's "
            "elastic agent does (TORCHELASTIC_RESTART_COUNT counts them); the cell fails with the last failure.",
        ),
        magic_arguments.argument(
            "--debug",
            action="store_true",
            help="a rank whose cell raises stays, paused, so that %%taas debug can open the debugger at the error.",
        ),
        magic_arguments.argument(
            "--debug-ranks",
            dest="debug_ranks",
            type=rank_list,
            default=None,
            metavar="RANKS",
            help="with the notebook's visual debugger on (JupyterLab's, VS Code's): the ranks that stop at its "
            "breakpoints and at breakpoint(), each a thread named 'rank N' (default: every rank).",
        ),
        magic_arguments.argument_group("sessions"),
        magic_arguments.argument(
            "--keep",
            action="store_true",
            help="start a session: the ranks stay alive after the cell, and the taas cells that follow run in "
            "them, with their names, process group and models (%%taas stop ends it).",
        ),
        magic_arguments.argument(
            "--ranks",
            type=rank_list,
            default=None,
            metavar="R,R",
            help="in a session: run the cell in these ranks only (0, 0,2 or 0-3); the others wait.",
        ),
        magic_arguments.argument(
            "--idle",
            type=seconds,
            default=None,
            metavar="SECONDS",
            help="with --keep: end the session after this many seconds without a cell (default 3600).",
        ),
        magic_arguments.argument_group("in the background"),
        magic_arguments.argument(
            "--background",
            action="store_true",
            help="the cell returns at once, with a handle to its run (.done(), .wait(), .stop(), .result), and the "
            "notebook runs other cells while it trains; its view and output stay in this cell, and its names join "
            "the notebook when it ends (%%taas runs lists such runs, %%taas wait waits for them). One-shot cells, "
            "and cells in a running session (which waits for them).",
        ),
        magic_arguments.argument("--check", default=None, metavar="NAME", help=argparse.SUPPRESS),
        # `#!NAME` alone while a cluster is connected: the cell as one process on such a node
        magic_arguments.argument("--alone", action="store_true", help=argparse.SUPPRESS),
    ]
    for decorator in reversed(decorators):
        func = decorator(func)
    return func


@dataclass(frozen=True)
class CellOptions:
    """A `%%taas` line's options as the parser leaves them, typed: one field per option (its ``dest``), an
    option left out holding its default. ``tests/unit/kernel`` keeps the fields and the parser the same."""

    gpus: int | None
    config: str | None
    device: Device | None
    start: Start | OldStart | None
    on: Place | None
    cpus: int | None
    units: int | None
    order: Order
    prefetch: int | None
    output: Output | None
    return_names: tuple[str, ...] | None
    return_from: Ranks | str | None
    timeout: float | None
    hang_after: float | None
    profile: bool
    max_restarts: int
    debug: bool
    debug_ranks: Ranks | None
    keep: bool
    ranks: Ranks | None
    idle: float | None
    background: bool
    check: str | None
    alone: bool

    @classmethod
    def of(cls, namespace: argparse.Namespace) -> "CellOptions":
        """The options ``parse`` returned; an option the parser lacks is an error here, not a default."""
        return cls(**{field.name: getattr(namespace, field.name) for field in fields(cls)})


def parse(magic: Callable[..., Any], line: str) -> argparse.Namespace:
    """Parse a `%%taas` line; anything unknown is a one-line error naming it and the allowed options."""
    parser: argparse.ArgumentParser = getattr(magic, "parser")  # attached by @magic_arguments
    parser.allow_abbrev = False  # `--gp 2` is a typo to report, not a guess to make
    if len(line) > MAX_LINE:  # splitting a huge line (a {name} holding megabytes) takes too long
        raise TaasUsageError(
            f"the options are {len(line)} characters long ({shortened(line)!r}): use at most {MAX_LINE}"
        )
    try:
        argv = arg_split(line, posix=True, strict=True)  # posix: quotes group words and are removed
    except ValueError as e:
        raise TaasUsageError(f"cannot split the options {shortened(line)!r}: {e}") from e
    try:
        namespace: argparse.Namespace
        namespace, unknown = parser.parse_known_args(argv)
    except UsageError as e:  # argparse's own message: "argument --gpus: ..."
        raise TaasUsageError(str(e)) from None
    if unknown:
        visible = visible_options(magic)
        meant = difflib.get_close_matches(unknown[0].split("=", 1)[0], visible, n=1, cutoff=0.75)
        hint = f" (did you mean {meant[0]}?)" if meant else ""
        raise TaasUsageError(f"unknown option {shortened(unknown[0])!r}{hint}: allowed are {', '.join(visible)}")
    return namespace


def offered_values(magic: Callable[..., Any], option: str) -> list[str] | None:
    """The values an option takes, as completion offers them (earlier names left out); None for
    an option of free values."""
    parser: argparse.ArgumentParser = getattr(magic, "parser")
    for action in parser._actions:
        if option in action.option_strings and action.choices is not None:
            return [value for value in action.choices if value not in OLD_STARTS]
    return None


def visible_options(magic: Callable[..., Any]) -> list[str]:
    """The options a user may give, in the order `%%taas?` lists them."""
    parser: argparse.ArgumentParser = getattr(magic, "parser")
    return [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS and action.option_strings[0] != "-h"
    ]


def default_device(environ: Mapping[str, str] | None = None) -> Device:
    environ = os.environ if environ is None else environ
    value = environ.get("TAAS_DEVICE", "").strip().lower() or "auto"
    for device in DEVICES:
        if value == device:
            return device
    raise TaasUsageError(f"TAAS_DEVICE={value!r} is not allowed: use {', '.join(DEVICES)}")


def transfer(command: str, words: list[str]) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """``%taas pull NAMES [--ranks RANKS]`` (and ``push``): the names, and the ranks (None: every rank).
    Names are separated by spaces or commas."""
    usage = f"%taas {command} NAMES [--ranks RANKS]"
    ranks: tuple[int, ...] | None = None
    names: list[str] = []
    rest = list(words)
    while rest:
        word = rest.pop(0)
        if word == "--ranks" and ranks is not None:
            raise TaasUsageError(f"{usage}: --ranks is given twice: give it once")
        if word == "--ranks" and not rest:
            raise TaasUsageError(f"{usage}: --ranks needs its ranks (--ranks 0,2 or --ranks 0-3)")
        if word == "--ranks":
            try:
                ranks = rank_list(rest.pop(0))
            except argparse.ArgumentTypeError as e:
                raise TaasUsageError(f"{usage}: --ranks {e}") from None
        elif word.startswith("-"):
            raise TaasUsageError(f"{usage}: {shortened(word)!r} is not allowed here: the one option is --ranks RANKS")
        else:
            names.extend(name for name in word.split(",") if name)
    bad = [name for name in names if not name.isidentifier()]
    if bad:
        raise TaasUsageError(f"{usage}: {shortened(bad[0])!r} is not a name")
    try:
        refuse_kernels_own(names)
    except ValueError as e:
        raise TaasUsageError(f"{usage}: {e}") from None
    if not names:
        raise TaasUsageError(f"{usage}: name at least one name (%taas {command} model or %taas {command} x,y)")
    return tuple(dict.fromkeys(names)), ranks
