"""The fork server: a process that has imported torch, never touches CUDA, and forks supervisors.

Started in the background when the extension loads (``python -m taas_magic.launch.forkserver.server FD``), it
does one thing per run: fork a supervisor (``launch/supervisor/main.py``), which unpacks the shipped names
and forks the ranks from itself, so they share them copy-on-write and start in milliseconds.
Nothing of a run ever lives in the server itself, so no run can leave it in a different state.

Its channel to the kernel carries requests one way only — a ``StartRun`` (``wire/fork_server.py``)
with the run's own channel end and the tensors' memory file beside it — and each request is one
datagram, so an interrupted kernel can never leave the two out of step. Everything about a run
travels on the run's own channel, between the kernel and the run's supervisor. The server is a
subreaper: processes of a supervisor that died come to it, and it ends them. It exits, ending
everything it started, when its channel closes or its parent dies, and at once (``_leave``).
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import socket
import sys

from taas_magic.delivery.cluster_ends import NodeEnds
from taas_magic.launch.supervisor.main import PARENT_CHECK_SECONDS, STOP_SECONDS, supervise
from taas_magic.launch.supervisor.tasks import Received, StoreServer
from taas_magic.process import child, containment, helper, logs, tracebacks
from taas_magic.rank import plugins
from taas_magic.wire import fork_server, shipping, supervision
from taas_magic.wire.channel import ChannelBroken
from taas_magic.wire.fork_server import ServerEnd, StartRun
from taas_magic.wire.task import RankTask

log = logging.getLogger("taas_magic.launch.forkserver.server")  # by name: the server runs as __main__


def main(fd: int) -> None:
    secret = helper.read_secret("fork server")
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a Ray worker starts it with SIGINT blocked: ranks inherit masks
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are the kernel's to forward
    containment.become_subreaper()
    import IPython.core.interactiveshell  # noqa: F401  (for cells with IPython syntax)
    import torch  # noqa: F401  (the reason this process exists: ranks start with torch imported)
    import torch.distributed  # noqa: F401

    plugins.find()

    gc.freeze()  # what is imported stays: forked supervisors and ranks never walk it
    control = fork_server.server_end(socket.socket(fileno=fd), secret)
    parent = os.getppid()
    supervisors: dict[int, int] = {}  # pidfd -> pid: a supervisor is reaped the moment it ends
    try:
        while os.getppid() == parent:
            ready = select.select([control.fileno(), *supervisors], [], [], PARENT_CHECK_SECONDS)[0]
            if control.fileno() in ready:
                request, fds = control.receive()
                pid = _fork_supervisor(control, request, fds)
                supervisors[os.pidfd_open(pid)] = pid
            _tend(supervisors)
    except ChannelBroken:
        pass  # the kernel closed the channel or is gone
    finally:
        containment.end_all_children(STOP_SECONDS)
    _leave()


def _leave() -> None:
    """End at once, without finalizing the interpreter: that takes a second or more with torch imported on a
    busy machine, and the server holds nothing the system does not release with the process. A kernel that
    died is to take its server along within moments, not after its modules are torn down."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fork_supervisor(control: ServerEnd, request: StartRun, fds: list[int]) -> int:
    run_id, secret, envs, task, shipment = request.run_id, request.secret, request.envs, request.task, request.shipment
    store, rest = (None, fds[1:]) if request.store is None else (StoreServer(request.store, fds[1]), fds[2:])
    logs.follow(next(iter(envs.values()), {}))  # this run's log, if it keeps one
    try:
        pid = os.fork()
        if pid == 0:  # the run's supervisor: never returns into the server's loop
            try:
                control.close()
                child.settle_forked_process()
                run_channel = supervision.supervisor_end(socket.socket(fileno=fds[0]), secret, run_id)
            except BaseException:
                os._exit(1)
            supervise(run_channel, envs, lambda: _unpack(task, shipment, rest), store)
        log.debug("run %s: supervisor %d forked for ranks %s", run_id, pid, sorted(envs))
        return pid
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass  # the supervisor's copy: already taken over by its channel


def _unpack(task: RankTask, shipment: shipping.Shipment, fds: list[int]) -> Received:
    """In the supervisor: the kernel's context first (imports may depend on sys.path), then the names,
    then (on a cluster node) the data delivery ends its agent passed, the last of ``fds``."""
    cut = len(fds) - (task.delivery.fd_count() if task.delivery is not None else 0)
    fds, delivery_fds = fds[:cut], fds[cut:]
    if task.context is not None:
        task.context.apply()
    tracebacks.register_sources(task.sources)
    try:
        namespace = shipping.unpack(shipment.data, fds[0] if fds else None, shipment.tensors_size)
    finally:
        for fd in fds:
            os.close(fd)
    child.find_interactive_flags()  # the shipped names may have imported Lightning
    ends = task.delivery
    attached = ends.attach(delivery_fds, namespace) if isinstance(ends, NodeEnds) else None
    return Received(task, namespace, attached)


def _tend(supervisors: dict[int, int]) -> None:
    """Reap supervisors that ended; end whatever else came to us: the leftovers of a supervisor that died."""
    for pidfd, pid in list(supervisors.items()):
        if select.select([pidfd], [], [], 0)[0]:
            os.close(pidfd)
            del supervisors[pidfd]
            os.waitpid(pid, 0)
    containment.end_all_children(0.0, spare=set(supervisors.values()))  # one pass: the loop comes back


if __name__ == "__main__":
    main(int(sys.argv[1]))
