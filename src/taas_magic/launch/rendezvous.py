"""A fresh rendezvous for every run, reachable from this machine only.

The kernel opens the listening socket of torch's TCPStore itself, bound to the loopback
address, and serves the store on exactly that socket for as long as the run lasts, as
torchrun's agent does: the port cannot be taken by anyone else between choosing and using it,
and nothing binds every interface as rank 0's ``init_process_group`` would on its own. All
ranks are told (``TORCHELASTIC_USE_AGENT_STORE``) to connect to it as clients, so
``init_process_group("nccl", init_method="env://")`` works unchanged.

Why the kernel: it waits anyway while the run's supervisor forks the ranks, so the store is
ready by the time they need it, at no cost to the start. A store served by a process of the
run would be started only after the last fork (its server thread must never be forked).

On a cluster, node 0's supervisor serves it (``hand_over``): the node's agent, a Ray worker, would
import torch only for that (2 s of CPU and about 500 MB). It serves it from a process of its own, forked
after its ranks (``serve_apart``): a session's supervisor forks again while the run goes on (a rank healed
or added, as the other nodes' ranks connect to the store), and a process forked while a server thread of
its own named a connection it accepted (``getnameinfo``) would inherit glibc's resolver lock held and hang
at its first connection. The ranks of every node wait in the socket's backlog until it serves.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from typing import Any

from taas_magic.process import containment

STORE_TIMEOUT = datetime.timedelta(minutes=30)


def new_run_id() -> str:
    return f"taas-{uuid.uuid4().hex[:12]}"


def listen(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` (a loopback address for one-node runs), on a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own store does
        sock.bind((host, 0))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


class RunStore:
    """The run's TCPStore: its socket listens from the start, it serves once ``serve`` is called.

    Open it before the run's processes are forked (its port goes into their environments) and
    serve it right after (its server thread is never forked with them); ranks that connect
    earlier wait in the socket's backlog, so none ever sees a refused connection. ``close``
    ends both, whatever was reached.
    """

    def __init__(self, envs: dict[int, dict[str, str]]):
        rank0 = envs[min(envs)]
        self.host = rank0["MASTER_ADDR"]
        self.world_size = int(rank0["WORLD_SIZE"])
        self._listener: socket.socket | None = listen(self.host)
        self.port: int = self._listener.getsockname()[1]
        self._server: Any = None

    def environments(self, envs: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
        """The ranks' environments, pointed at this store."""
        return {
            rank: {**env, "MASTER_PORT": str(self.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
            for rank, env in envs.items()
        }

    def serve(self) -> None:
        if self._listener is None:
            raise RuntimeError("the run's store was closed before it could serve")
        fd = self._listener.detach()  # the store owns it from here, and closes it when it ends
        self._listener = None
        self._server = serve_on(fd, self.host, self.port, self.world_size)

    def put(self, key: str, value: str) -> bool:
        """``value`` under ``key`` for the run's processes to read; False if the store is not served here."""
        if self._server is None:
            return False
        self._server.set(key, value)
        return True

    def hand_over(self) -> int:
        """The listening socket's descriptor, for a process of the run to serve the store on
        (``serve_on``), after its last fork: the caller sends it and closes its own copy."""
        if self._listener is None:
            raise RuntimeError("the run's store was closed before it could be handed over")
        fd, self._listener = self._listener.detach(), None
        return fd

    def close(self) -> None:
        """Stop serving and close the port: the store's server thread ends with its last reference."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._server = None


def serve_on(fd: int, host: str, port: int, world_size: int) -> Any:
    """Serve a run's store on the listening socket ``fd`` (which it owns from then on) until the object
    returned is dropped."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public (documented), not in __all__

    # torch's classic server: the libuv one leaves a pipe of its own open in the kernel for good
    return TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=fd,
        timeout=STORE_TIMEOUT,
        use_libuv=False,
    )


class StoreProcess:
    """A run's store served by a process of its own (``serve_apart``), which ends with the process that forked it;
    ``set`` puts a key in it as one of its clients."""

    def __init__(self, pid: int, lifeline: int, host: str, port: int):
        self.pid = pid
        self.lifeline = lifeline  # its write end: the store process ends when it closes
        self.host, self.port = host, port
        self._client: Any = None

    def set(self, key: str, value: str) -> None:
        if self._client is None:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            self._client = TCPStore(self.host, self.port, is_master=False, timeout=STORE_TIMEOUT, use_libuv=False)
        self._client.set(key, value)

    def close(self) -> None:
        """The store ends, its port closed, its process reaped."""
        self._client = None
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1
            containment.end_child(self.pid)


def serve_apart(fd: int, host: str, port: int, world_size: int) -> StoreProcess:
    """Serve a run's store on the listening socket ``fd`` from a process forked here, which keeps nothing of this
    one's but that socket, and ends when this one closes the store or dies."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the store's process: the socket and the lifeline, nothing else
        try:
            os.close(write_end)
            containment.drop_all_but({fd, read_end})
            server = serve_on(fd, host, port, world_size)
            while os.read(read_end, 1):
                pass
            del server
        finally:
            os._exit(0)
    os.close(read_end)
    os.close(fd)
    return StoreProcess(pid, write_end, host, port)
