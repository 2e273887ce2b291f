"""``%taas resize N``, in the kernel: a session's number of ranks, changed while it lives.

Every rank of the new size is sent one cell with no code (``SessionCell.resize``): the supervisor ends the ranks
that leave, or starts the new ones, and every rank connects the process group anew, the new ones given what the
others hold alike (``Session.regroup``, ``rank/group_links.py``, ``rank/healing.py``). A cluster session that lost
its last node shrinks the same way (``Session.go_on_without``). On a cluster a session has whole nodes: its last
ones leave (their nodes stay held for it), or the cluster's driver starts the new ranks on the nodes its placement
holds for them first, then on nodes it adds (``ClusterRanks.grow``, ``launch/cluster/growth.py``).
"""

from __future__ import annotations

import time

from taas_magic.errors import TaasUsageError
from taas_magic.kernel.header.option_values import count
from taas_magic.kernel.header.spec import resized, resized_on_nodes
from taas_magic.kernel.sessions.session import Session
from taas_magic.kernel.view import render
from taas_magic.kernel.view.front_end import CellFrontEnd
from taas_magic.launch.backend import GrowingGroup
from taas_magic.per_rank import span


def resize(session: Session, world: int, front: CellFrontEnd) -> str:
    """``%taas resize``: ``session`` goes on with ``world`` ranks, its process group and DDP models around them
    all: ranks ``world`` and up end, or new ones join, given what the others hold alike; what changed, in a
    line. Refused in one line, before anything changes, where it cannot be done."""
    why_not = refusal(session)
    if why_not:
        raise TaasUsageError(
            f"%taas resize {world}: {why_not}: %taas stop, then start a session of {world} with --keep"
        )
    on_nodes = session.start == "cluster"
    resized_spec = resized_on_nodes(session.spec, world) if on_nodes else resized(session.spec, world)
    session.replace_the_dead(front)
    old, started = session.size, time.monotonic()
    if world == old:
        return f"taas: the session has {count(old, 'rank')} already"
    if world > old and isinstance(session.group, GrowingGroup):
        try:
            session.group.grow(world, resized_spec.nodes)
        except TaasUsageError as e:
            raise TaasUsageError(f"%taas resize {world}: {e}") from None
    session.spec, session.failed = resized_spec, [rank for rank in session.failed if rank < world]
    session.regroup(front, resized_from=old)
    if session.ended:
        raise render.session_over(session.ended)
    took = f"({time.monotonic() - started:.1f} s)"
    if world < old:
        return f"taas: the session has {count(world, 'rank')} now: {span(range(world, old))} ended {took}"
    return f"taas: the session has {count(world, 'rank')} now: {span(range(old, world))} joined {took}"


def refusal(session: Session) -> str:
    """Why ``%taas resize`` cannot change ``session``, or ''."""
    if session.start == "cluster" and session.plans:
        return "the session on the cluster serves registered loaders, whose producers were placed for its nodes"
    if session.spec.device != "cpu":
        return f"its ranks are on {session.spec.device}, and only a CPU session (gloo) can be resized"
    return ""
