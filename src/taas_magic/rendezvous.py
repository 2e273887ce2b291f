"""A fresh rendezvous for every run, reachable from this machine only.

The run's supervisor opens the listening socket of torch's TCPStore itself, bound to the
loopback address, before any rank starts, and serves the store on exactly that socket, as
torchrun's agent does: the port cannot be taken by anyone else between choosing and using it,
and nothing binds every interface as rank 0's ``init_process_group`` would on its own. All
ranks are told (``TORCHELASTIC_USE_AGENT_STORE``) to connect to it as clients, so
``init_process_group("nccl", init_method="env://")`` works unchanged.
"""

from __future__ import annotations

import datetime
import socket
import uuid
from typing import Any

_store: Any = None  # the run's store server, alive as long as the supervisor


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


def with_store(envs: dict[int, dict[str, str]], listener: socket.socket) -> dict[int, dict[str, str]]:
    """The ranks' environments, pointed at the run's own store."""
    port = str(listener.getsockname()[1])
    return {rank: {**env, "MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "True"} for rank, env in envs.items()}


def serve_store(listener_fd: int, env: dict[str, str]) -> None:
    """In the supervisor, once the ranks are forked: serve the run's TCPStore on its listening socket.

    Ranks that connect before this runs wait in the socket's backlog, so none ever sees a refused
    connection. Its server thread starts only after the last fork, as threads and forks do not mix.
    """
    global _store
    from torch._C._distributed_c10d import TCPStore

    _store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=True,
                      wait_for_workers=False, master_listen_fd=listener_fd, timeout=datetime.timedelta(minutes=30))
