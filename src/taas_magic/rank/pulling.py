"""A `%taas pull` while a session's cell runs in the background: the asked ranks send the names between two optimizer
steps, every rank at the same one, and the cell goes on.

The kernel puts the request in the run's store (``PULL_KEY``) and sends ``PULL_TOGETHER``; ``stopping.StepStops``
takes it at the step the ranks agree on, as it takes an interrupt, and this module answers: the names as the cell
has them then, pickled as a cell's end pickles them (``Pulled``, large ones in a memory file). A sharded tensor is
left out: gathering it would be a collective, in the middle of the cell's own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from taas_magic.rank import run_store
from taas_magic.wire import memfile, results
from taas_magic.wire.channel import INLINE_LIMIT, ChannelBroken
from taas_magic.wire.rank_control import PULL_KEY, Pulled, RankEnd


@dataclass(frozen=True)
class PullRequest:
    number: int  # the session's count of pulls: it names the step the ranks agree on
    names: tuple[str, ...]
    ranks: tuple[int, ...]  # those that answer


def request() -> PullRequest | None:
    """The pull the kernel asks for now, from the run's store; None if there is none to read."""
    try:
        asked = json.loads(run_store.client().get(PULL_KEY))
        return PullRequest(int(asked["number"]), tuple(asked["names"]), tuple(asked["ranks"]))
    except Exception:
        return None


def answer(asked: PullRequest, namespace: dict[str, Any], control: RankEnd) -> None:
    """This rank's values of the names asked for, sent to the kernel, if it is one of the ranks asked."""
    if int(os.environ.get("RANK", "0")) not in asked.ranks:
        return
    present = {name: namespace[name] for name in asked.names if name in namespace}
    packed, _ = results.dumps(present)  # what cannot be sent stays out: the kernel says which names did not come
    names, in_file, fds = message_parts(packed)
    try:
        control.send(Pulled(asked.number, names, in_file), fds)
    except ChannelBroken:
        pass  # the session is over: the kernel stops waiting as the cell ends
    finally:
        for fd in fds:
            os.close(fd)


def message_parts(packed: results.Packed) -> tuple[bytes | None, int | None, list[int]]:
    """Names for a message: their bytes in it when small, else a sealed memory file beside it (its size, its
    descriptor): the supervisor hands it on to the kernel as it is, and the kernel maps it."""
    if packed.size <= INLINE_LIMIT:
        return packed.to_bytes(), None, []
    fd = memfile.new_file("taas-names", packed.size)
    try:
        packed.write(fd)
        memfile.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return None, packed.size, [fd]
