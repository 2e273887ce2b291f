"""``%taas stacks`` between a session's cells, in the kernel: where each of its processes is, grouped.

A rank whose main thread waits in taas's own code for the next cell is idle; the threads of the user's that it
runs still show, since one stuck there (in a collective, a loop) is what the next cell meets.
"""

from __future__ import annotations

import re
from typing import Mapping

from taas_magic.kernel.diagnosis import hang, stacks
from taas_magic.kernel.header.spec import LaunchSpec
from taas_magic.kernel.running.controller import STACK_SECONDS
from taas_magic.launch.backend import SessionGroup
from taas_magic.wire.events import Key
from taas_magic.wire.records import split_position

# A module of Python's own standard library, on whichever machine the dump was taken (a cluster's node too).
_STANDARD_LIBRARY = re.compile(r"/lib/python3\.\d+/(?!site-packages/|dist-packages/)")


def where(group: SessionGroup, labels: Mapping[Key, str], spec: LaunchSpec, cell_names: Mapping[str, str]) -> list[str]:
    """Each place a live session's ranks and producers (``group``, the producers named by ``labels``) are, once
    for all at the same place."""
    keys = group.running()
    dumps = group.stacks(keys, STACK_SECONDS) if keys else {}
    processes = []
    for key in keys:
        label = labels.get(key, f"rank {key}")
        position, dump = split_position(dumps.get(key, ""))  # where its collectives were, with its stacks
        idle = _idle(key, dump)  # then only the threads the user started are worth showing
        processes.append(
            hang.Process(key, label, activity=position, stack=dump)
            if idle is None
            else hang.Process(key, label, stack=stacks.other_threads(dump), ended=idle)
        )
    return hang.where_lines(processes, cell_names, spec.ranks_per_node if spec.nodes > 1 else 0)


def _idle(key: Key, dump: str) -> str | None:
    """What a process does between cells when its main thread waits in taas's own code (and the standard
    library calls that code made): a rank in its session loop for the next cell (``rank/session.py``), a
    producer for the ranks (``delivery/producer.py``, building nothing). None when it runs anything else:
    code of the user's or of a library."""
    threads = stacks.parse_stacks(dump)
    if not threads or not threads[0].main or not threads[0].frames:
        return None
    if not all("/taas_magic/" in frame.file or _STANDARD_LIBRARY.search(frame.file) for frame in threads[0].frames):
        return None
    return "idle, waiting for the next cell" if isinstance(key, int) else "idle, waiting for the ranks"
