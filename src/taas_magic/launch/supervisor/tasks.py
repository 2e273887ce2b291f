"""What a supervisor starts its processes with, and what each forked process is there for.

A supervisor is started with a ``Received``: the task as the kernel sent it, and what the process that
started the supervisor added to it. Each process it forks runs a rank's cells or a data producer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, assert_never

from taas_magic.delivery.cluster_ends import AttachedDelivery, FedLoader
from taas_magic.delivery.producer import ProducerTask
from taas_magic.delivery.service import RankLoader
from taas_magic.launch import rendezvous
from taas_magic.process import child
from taas_magic.rank import worker
from taas_magic.wire.fork_server import StoreToServe
from taas_magic.wire.task import RankTask


@dataclass(frozen=True)
class Received:
    """What a supervisor starts its ranks with: the task as the kernel sent it, and what the process that
    started the supervisor added: the names it unpacked from a shipment (the fork server), a cluster
    node's share of data delivery (its agent)."""

    task: RankTask
    shipped: dict[str, Any] | None = None
    attached: AttachedDelivery | None = None


@dataclass(frozen=True)
class StoreServer:
    """The run's store (``store``), served on the listening socket ``fd`` once the supervisor's ranks are forked,
    by a process forked for it (``rendezvous.serve_apart``): no server thread is ever in the supervisor, which
    forks again in a session (a rank healed or added, a late loader's producers) while other nodes' ranks may
    connect to the store."""

    store: StoreToServe
    fd: int

    def serve(self) -> rendezvous.StoreProcess:
        """Start serving; the store serves until the returned process is closed, or the supervisor ends."""
        return rendezvous.serve_apart(self.fd, self.store.host, self.store.port, self.store.world_size)


def kernel_namespace() -> dict[str, Any]:
    """The notebook's names, in a process forked from the kernel (empty in any other)."""
    from IPython import get_ipython

    shell = get_ipython()
    namespace: dict[str, Any] = shell.user_ns if shell is not None else {}  # forked from the kernel: its own
    return namespace


def producer_env(run_id: str) -> dict[str, str]:
    """Producers are CPU workers of the run: its id, no rank, no GPU, one thread each."""
    return {"TAAS_RUN_ID": run_id, "TAAS_ROLE": "producer", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def run_forked(
    task: RankTask | ProducerTask,
    env: dict[str, str],
    fds: child.RankFds,
    stand_ins: tuple[RankLoader | FedLoader, ...],
    shipped: dict[str, Any] | None,
) -> int:
    """In a forked process: what it is there for; returns its exit status."""
    match task:
        case RankTask():
            return worker.run_rank(task, env, fds, stand_ins, shipped)
        case ProducerTask():
            return task.run(env, fds)
        case _:
            assert_never(task)
