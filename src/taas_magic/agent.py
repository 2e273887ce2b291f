"""The fork server: a process that has imported torch, never touches CUDA, and forks ranks.

Started in the background when the extension loads (``python -m taas_magic.agent FD``), it
serves one run at a time over its channel to the kernel: it unpacks the shipped namespace once,
forks the ranks from itself (so they share it copy-on-write and start in milliseconds), and
relays their events. It is a node agent in miniature: the same requests would drive a remote one.

It lives as long as its channel: when the kernel closes it or dies, the agent stops its ranks
and exits. Requests: ("run", envs, task, shipment) → events…, ("signal", signum, ranks),
("stacks", ranks, timeout), ("close",) → ("closed",).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import select
import signal
import socket
import sys

from . import channel, shipping
from .fork import ForkBackend, ForkedRanks

POLL_SECONDS = 0.02


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are the kernel's to forward
    sock = socket.socket(fileno=fd)
    import IPython.core.interactiveshell  # noqa: F401  (for cells with IPython syntax)

    gc.freeze()  # what is imported stays: collections after each run look at the run's objects only
    import torch  # noqa: F401  (the reason this process exists: ranks start with torch imported)
    import torch.distributed  # noqa: F401

    channel.send(sock, ("ready", os.getpid()))
    try:
        while True:
            message, fds = channel.receive(sock)
            if message[0] == "run":
                _serve(sock, message, fds)
                gc.collect()  # the run's namespace and tensor mapping go now, not at some later cell
            elif message[0] == "close":
                channel.send(sock, ("closed",))
    except (channel.ChannelClosed, ConnectionError):
        pass


def _serve(sock: socket.socket, message: tuple, fds: list[int]) -> None:
    _, envs, task, shipment = message
    group: ForkedRanks | None = None
    try:
        if task.context is not None:
            task.context.apply()  # before unpickling: imports may depend on sys.path and the folder
        try:
            namespace = shipping.unpack(shipment.data, fds[0] if fds else None, shipment.tensors_size)
        finally:
            for fd in fds:
                os.close(fd)
        group = ForkBackend().start(envs, dataclasses.replace(task, namespace=namespace))
        del namespace
        channel.send(sock, ("started",))
        _relay(sock, group)
    except (channel.ChannelClosed, ConnectionError):
        raise
    except BaseException as e:
        channel.send(sock, ("failed", f"{type(e).__name__}: {e}"))
    finally:
        if group is not None:
            group.close()
        try:
            channel.send(sock, ("closed",))
        except OSError:
            pass


def _relay(sock: socket.socket, group: ForkedRanks) -> None:
    """Pass the ranks' events on and the kernel's requests in, until the kernel says close."""
    while True:
        if select.select([sock], [], [], 0)[0]:
            request, _ = channel.receive(sock)
            if request[0] == "close":
                return
            if request[0] == "signal":
                group.signal(request[1], request[2])
            elif request[0] == "stacks":
                channel.send(sock, ("stacks", group.stacks(request[1], request[2])))
        events = group.events(POLL_SECONDS)
        if events:
            channel.send(sock, ("events", events))


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass


if __name__ == "__main__":
    _die_with_parent()
    main(int(sys.argv[1]))
