"""Real ranks forked from a test, with their run's store served here the way the product serves it.

``launch/rendezvous.py``'s order: the store's listening socket is opened first, the ranks are forked, and the
store is served only then. A TCPStore served before the fork is forked with its server thread in whatever call
it is in, and that thread names every connection it accepts (``getnameinfo``): a rank forked while it did so
inherits glibc's resolver lock held by a thread it does not have, and hangs for good at its own first
connection (found in CI: one rank of three never began, and its peers waited in ``init_process_group``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from taas_magic.launch import rendezvous

HOST = "127.0.0.1"


@dataclass
class Ranks:
    """The forked ranks, their ends of a pipe each, and the run's store as a client of this process."""

    store: Any
    processes: list[Any]
    conns: list[Connection]


@contextlib.contextmanager
def forked_ranks(target: Callable[..., None], world: int, *args: Any) -> Iterator[Ranks]:
    """``world`` processes, each running ``target(rank, store_port, conn, *args)``; killed and reaped at the end,
    whatever happened. A rank that dies closes its pipe: its ``conn`` polls ready and its ``recv`` raises
    ``EOFError``, rather than being taken for a rank that waits."""
    listener = rendezvous.listen(HOST)
    port = listener.getsockname()[1]
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe() for _ in range(world)]
    processes = [
        context.Process(target=_rank, args=(listener.fileno(), target, rank, port, pipes[rank][1], *args), daemon=True)
        for rank in range(world)
    ]
    store = None
    try:
        for process in processes:
            process.start()
        for _, theirs in pipes:
            theirs.close()
        store = rendezvous.serve_on(listener.detach(), HOST, port, world)
        yield Ranks(store, processes, [ours for ours, _ in pipes])
    finally:
        listener.close()
        for process in processes:
            if process.pid is not None:
                process.kill()
                process.join(10)
        del store


def _rank(listener: int, target: Callable[..., None], *args: Any) -> None:
    os.close(listener)  # the store's, served by the test's process only
    target(*args)
