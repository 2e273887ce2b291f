"""A cell in a running session: the options it may choose, and which of the session's ranks it runs in.

A session's size, device and start are fixed when it starts (``--keep``); a cell in it may choose only
``SESSION_CELL_OPTIONS``, and ``--ranks`` runs it in part of the session. ``%taas pull`` and ``push`` run
as cells of the session's too, with no code.
"""

from __future__ import annotations

import argparse
from typing import Any, Collection

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header.option_values import rank_text, ranks_as_typed
from taas_magic.kernel.running import delivery_planning
from taas_magic.kernel.sessions import resizing
from taas_magic.kernel.sessions.session import Session
from taas_magic.launch.backend import Cell
from taas_magic.per_rank import span
from taas_magic.wire.task import LoaderPlan

SESSION_CELL_OPTIONS = "--ranks, --return, --from, --timeout, --hang-after, --output, --debug-ranks and --profile"


def check_fits_session(args: argparse.Namespace, session: Session) -> None:
    """A cell in a session may choose only ``SESSION_CELL_OPTIONS``; an option that would make it another run
    (its size, device, configuration, start) is an error, and so is one that only a one-shot run uses."""
    spec = session.spec
    same = {
        "--gpus": args.gpus in (None, spec.world_size),
        "--config": args.config is None or (spec.configuration is not None and args.config == spec.configuration.name),
        "--device": args.device in (None, "auto", spec.device),
        "--start": args.start in (None, "auto", session.start, "spawn" if session.start == "forkserver" else ""),
        "--on": args.on in (None, "cluster" if session.start == "cluster" else "local"),
    }
    one_shot = {
        "--cpus": args.cpus is not None,
        "--units": args.units is not None,
        "--prefetch": args.prefetch is not None,
        "--order": args.order != "deterministic",
        "--max-restarts": args.max_restarts != 0,
        "--debug": args.debug,
        "--idle": args.idle is not None,
    }
    changed = [name for name, ok in same.items() if not ok]
    if changed == ["--gpus"] and not resizing.refusal(session):
        raise TaasUsageError(
            f"--gpus {args.gpus}: the session has {session.size} ranks: %taas resize {args.gpus} changes them "
            "(its names kept), or drop --gpus from the cell"
        )
    if changed:
        raise TaasUsageError(
            f"{', '.join(changed)} would change the running session ({session.size} ranks on "
            f"{spec.device}): %taas stop first, then start another with --keep"
        )
    others = [name for name, given in one_shot.items() if given]
    if others:
        raise TaasUsageError(
            f"{', '.join(others)} cannot apply to a cell in a session: a cell there takes "
            f"{SESSION_CELL_OPTIONS} (%taas stop ends the session)"
        )


def session_ranks(given: tuple[int, ...] | None, session: Session) -> list[int]:
    """The session's ranks a cell (or ``%taas push``) runs in: ``--ranks``, else every rank."""
    ranks = list(given) if given is not None else list(range(session.size))
    outside = [rank for rank in ranks if rank >= session.size]
    if outside:
        raise TaasUsageError(
            f"--ranks {ranks_as_typed(given or ranks)}: the session has {span(range(session.size))}, "
            f"not rank {rank_text(outside[0])}"
        )
    return ranks


def cell_ranks(ranks: list[int], session: Session) -> str:
    """The ranks a session cell runs in, as ``--from``'s error names them."""
    return "the session" if len(ranks) == session.size else f"the cell (--ranks {','.join(map(str, ranks))})"


def running_ranks(ranks: list[int], session: Session) -> frozenset[int] | None:
    """The ranks a cell runs in, when it runs in part of the session (None: in every rank)."""
    return None if len(ranks) == session.size else frozenset(ranks)


NOTHING = compile("", "<taas>", "exec")  # the code of %taas pull and push: the names are all they do


def command_cell(command: str, reads: tuple[str, ...], namespace: dict[str, Any]) -> Cell:
    """``%taas pull`` or ``push`` as a cell of the session's: no code, reading ``reads`` from the notebook."""
    return Cell(frozenset(reads), (), namespace, f"%taas {command}", "<taas>")


def new_loaders(
    reads: Collection[str], session: Session, ranks: list[int], namespace: dict[str, Any]
) -> tuple[LoaderPlan, ...]:
    """Plans for the registered loaders a cell reads that the session does not serve yet (registered since
    it started): the cell starts their producers. Served loaders go to every rank: a cell in part of the
    session may not use one."""
    if session.spec.cpus == 0:
        return ()  # delivery is off: each rank iterates every loader itself
    names = delivery_planning.loaders_used(reads, namespace)
    if names and len(ranks) < session.size:
        raise TaasUsageError(
            f"--ranks {','.join(map(str, ranks))}: the cell uses {names[0]!r}, which producers "
            "serve to every rank of the session: run it in every rank (leave out --ranks)"
        )
    new = [name for name in names if not session.serves(name, namespace[name])]
    return delivery_planning.plans(session.spec, new, namespace)
