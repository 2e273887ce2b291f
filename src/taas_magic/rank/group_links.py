"""A session rank's process-group connections: known, cut when its cell fails, and made anew under the group.

A rank whose cell raised while its peers wait for it in a collective (DDP's all_reduce in ``backward()``)
would leave them waiting for as long as the group's timeout, half an hour by default: torch has no call
that ends a gloo wait on a peer that is alive (``ProcessGroup.abort`` and ``shutdown`` do not). A closed
connection does: the peer's wait fails at once with gloo's "Connection closed by peer", which taas reads as
a peer lost (``Failed.peer_lost``), not as an error of that rank's own. So a session rank whose cell ends
with an error or an interrupt cuts its groups' connections (``cut``), and each peer it releases does the
same: within milliseconds every rank has left the cell, at the collective the first one never reached,
each with the same optimizer steps applied unless the failing rank raised between two collectives. An
interrupt that the ranks took together before one optimizer step (``stopping.py``) leaves nobody waiting:
nothing is cut.

The kernel then has every rank connect the default group anew (``regroup``): each puts its handle in the
run's store, takes its peers', and torch reconnects the same ``ProcessGroup`` object in place, in
milliseconds. Every user object holding the group goes on with it in the next cell. DDP models are given a
new reducer each, in every rank alike: the failed collective left each rank's at another point of its
iteration (one had begun a backward, another had not), and reducers that disagree wait for each other.

Which sockets are the groups': those opened while torch made a process group (``init_process_group``,
``new_group``: both go through the maker ``torch_private.wrap_group_maker`` wraps) or while this module
reconnected one, less the connection to the run's store. Groups made with ``new_group`` are cut with the
rest but not made anew: a cell makes them again.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
from datetime import timedelta
from typing import Any, Callable, Iterator

from taas_magic import torch_private
from taas_magic.rank import run_store

REGROUP_SECONDS = 30.0  # every rank is between cells as the kernel asks: the handles come at once
NO_GROUP = "-"  # the handle of a rank that has no group to reconnect


class GroupLinks:
    """The sockets of the process groups this rank made."""

    def __init__(self) -> None:
        self.sockets: set[str] = set()  # each one's identity, as /proc names it: "socket:[123]"
        self.undo: Callable[[], None] | None = None

    def install(self) -> None:
        """For the session's life: note the sockets of every group torch makes from now on."""
        dist = _distributed()
        if dist is not None:
            self.undo = torch_private.wrap_group_maker(dist, self._noting)

    def uninstall(self) -> None:
        if self.undo is not None:
            self.undo()

    def _noting(self, maker: Callable[..., Any]) -> Callable[..., Any]:
        def make_group(*args: Any, **kwargs: Any) -> Any:
            with self.noting():
                return maker(*args, **kwargs)

        return make_group

    @contextlib.contextmanager
    def noting(self) -> Iterator[None]:
        """The sockets opened meanwhile are the groups' (the store's own connection aside)."""
        before = set(_sockets())
        try:
            yield
        finally:
            store = _store_port()
            self.sockets |= {name for name, fd in _sockets().items() if name not in before and _peer_port(fd) != store}

    def cut(self) -> bool:
        """Shut every connection of this rank's groups, so that no peer waits for it; whether it has a group (whose
        connections gloo may have closed already, as a peer cut its own or died): the group needs connecting anew."""
        for name, fd in _sockets().items():
            if name in self.sockets:
                _shut(fd)
        return bool(self.sockets)

    def regroup(self, number: int, newcomers: tuple[int, ...] = ()) -> None:
        """Connect the default group anew with every peer of the run, as communicator ``number`` (each regroup
        of a run has its own); ``newcomers``, in place of ranks that died, join it. Every rank of the session calls
        it at once, between cells."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, key = run_store.client(), f"taas/regroup/{number}/"
        group = _default_group(_distributed()) if rank not in newcomers else _join(store, key, newcomers, world)
        dist = _distributed()
        store.set(key + str(rank), NO_GROUP if group is None else group.get_reconfigure_handle())
        handles = [store.get(key + str(peer)).decode() for peer in range(world)]
        if group is None and all(handle == NO_GROUP for handle in handles):
            return
        missing = [peer for peer, handle in enumerate(handles) if handle == NO_GROUP]
        if missing:
            raise RuntimeError(
                f"taas: the process group cannot be connected again: rank {missing[0]} has none "
                "(every rank must call init_process_group)"
            )
        old = set(self.sockets)
        with self.noting():
            torch_private.reconfigure(dist, group, number, handles, timedelta(seconds=REGROUP_SECONDS))
        self.sockets -= old  # gone with the group's old communicator
        _renew_reducers(dist, group)

    def grouped(self) -> bool:
        """Whether this rank is in a process group of the session's ranks."""
        return _default_group(_distributed()) is not None


def _join(store: Any, key: str, newcomers: tuple[int, ...], world: int) -> Any:
    """A newcomer's default group, made to be connected by ``reconfigure`` with the same backend as the others'
    (a peer's handle names it); None when they have none."""
    survivor = next(peer for peer in range(world) if peer not in newcomers)
    handle = store.get(key + str(survivor)).decode()
    if handle == NO_GROUP:
        return None
    import torch.distributed as dist

    dist.init_process_group(handle.split(":")[0], init_method="env://", enable_reconfigure=True)
    return _default_group(dist)


def _renew_reducers(dist: Any, group: Any) -> None:
    """Every DDP model on ``group`` starts its iterations anew, in every rank alike: a collective that failed left
    each rank's reducer wherever that rank was (one had begun an iteration's backward, another had not), and
    reducers that disagree on their iteration wait for each other's bucket exchange for ever."""
    from torch.nn.parallel import DistributedDataParallel

    for model in gc.get_objects():
        if isinstance(model, DistributedDataParallel) and getattr(model, "process_group", None) is group:
            torch_private.renew_reducer(model)


def _distributed() -> Any:
    """torch.distributed, where the rank has imported torch and it has one."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def _default_group(dist: Any) -> Any:
    """The default group where it can be connected anew (one of one rank too: a session resized to one grows
    again); None where there is none."""
    if dist is None or not dist.is_initialized():
        return None
    group = torch_private.default_group(dist)
    return group if group.supports_reconfigure else None


def _sockets() -> dict[str, int]:
    """This process's sockets: identity -> a descriptor of it (none where /proc cannot say)."""
    found = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for fd in fds:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor too)
        if name.startswith("socket:"):
            found[name] = int(fd)
    return found


def _store_port() -> int:
    try:
        return int(os.environ.get("MASTER_PORT", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def _tcp_socket(fd: int) -> Iterator[socket.socket | None]:
    """While inside, a socket object over a duplicate of ``fd`` when it is a TCP socket, else None; ``fd`` itself
    stays its owner's (gloo's)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    try:
        tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        yield sock if tcp else None
    finally:
        sock.close()


def _peer_port(fd: int) -> int:
    """The port at the other end of TCP socket ``fd``; 0 for any other socket."""
    with _tcp_socket(fd) as sock:
        try:
            return int(sock.getpeername()[1]) if sock is not None else 0
        except OSError:
            return 0  # listening, or not connected


def _shut(fd: int) -> bool:
    """Shut a connected TCP socket both ways (its descriptor stays gloo's, to close); whether it was one."""
    with _tcp_socket(fd) as sock:
        if sock is None:
            return False
        try:
            sock.getpeername()  # a listening socket has none, and stays: gloo's own, not a connection
            sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
