"""A `%taas pull` while a session's cell runs in the background: the asked ranks send the names between two optimizer
steps, every rank at the same one, and the cell goes on.

The kernel puts the request in the run's store (``PULL_KEY``; on a cluster, node 0's supervisor puts it and says when
it is there) and then sends ``PULL_TOGETHER``; a rank reads the request numbered after the last it read (one that
reads too early waits for it). ``stopping.StepStops``
takes it at the step the ranks agree on, as it takes an interrupt, and this module answers: the names as the cell
has them then, pickled as a cell's end pickles them (``Pulled``, large ones in a memory file). A sharded tensor is
left out: gathering it would be a collective, in the middle of the cell's own.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from taas_magic.rank import names_out, run_store
from taas_magic.wire import results
from taas_magic.wire.rank_control import PULL_KEY, Pulled, RankEnd

READ_SECONDS = 10.0  # how long a rank told of a pull waits for its request to be in the store
READ_AGAIN_SECONDS = 0.005


@dataclass(frozen=True)
class PullRequest:
    number: int  # the session's count of pulls: it names the step the ranks agree on
    names: tuple[str, ...]
    ranks: tuple[int, ...]  # those that answer


def request(after: int) -> PullRequest | None:
    """The pull the kernel asks for now: the request in the run's store numbered after ``after`` (the last this rank
    read; pulls are numbered across the kernel), waited for ``READ_SECONDS``; None if none can be read."""
    deadline = time.monotonic() + READ_SECONDS
    while True:
        try:
            asked = json.loads(run_store.client().get(PULL_KEY))
            found = PullRequest(int(asked["number"]), tuple(asked["names"]), tuple(asked["ranks"]))
        except Exception:
            return None
        if found.number > after:
            return found
        if time.monotonic() >= deadline:
            return None
        time.sleep(READ_AGAIN_SECONDS)


def answer(asked: PullRequest, namespace: dict[str, Any], control: RankEnd) -> None:
    """This rank's values of the names asked for, sent to the kernel, if it is one of the ranks asked."""
    if int(os.environ.get("RANK", "0")) not in asked.ranks:
        return
    present = {name: namespace[name] for name in asked.names if name in namespace}
    packed, _ = results.dumps(present)  # what cannot be sent stays out: the kernel says which names did not come
    names_out.send(control, lambda inline, in_file: Pulled(asked.number, inline, in_file), packed)
