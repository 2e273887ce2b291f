"""The conversation between the kernel (or a cluster node's agent) and its fork server.

It goes one way only: one ``StartRun`` per run, with the run's own channel end, the listening socket
of the run's store (on a cluster's node 0), the tensors' memory file and (on a cluster node) the data
delivery's ends beside it. Each is one datagram, so
an interrupted kernel can never leave the two out of step. Everything else about the run travels
on the run's own channel, between the kernel and the run's supervisor (``supervision.py``).

``kind`` is each message's name in what taas says about it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import ClassVar, NoReturn

from taas_magic.wire.channel import Channel
from taas_magic.wire.shipping import Shipment
from taas_magic.wire.task import RankTask

CONTROL = "fork-server"  # the run id the fork server's channel's messages carry


@dataclass(frozen=True)
class StoreToServe:
    """The run's store, for the supervisor to serve once its ranks are forked, on the listening socket
    that comes second with the message (on a cluster, node 0's: ``launch/rendezvous.py``)."""

    host: str
    port: int
    world_size: int


@dataclass(frozen=True)
class StartRun:
    """Fork a supervisor for run ``run_id``; it talks on the channel end that comes first with the
    message, with ``secret``, and starts ranks with ``envs`` running ``task`` over the names ``shipment``
    holds; and serves ``store``, when given."""

    kind: ClassVar[str] = "run"
    run_id: str
    secret: bytes
    envs: dict[int, dict[str, str]]
    task: RankTask
    shipment: Shipment
    store: StoreToServe | None = None


ToForkServer = StartRun
FromForkServer = NoReturn  # the server answers nothing: a run's news comes on the run's own channel

# Who sends what to whom: docs/architecture.md's table of messages lists exactly these (test_protocol.py).
DIRECTIONS = (("kernel or agent", "fork server", ToForkServer),)

KernelEnd = Channel[ToForkServer, FromForkServer]
ServerEnd = Channel[FromForkServer, ToForkServer]


def kernel_end(sock: socket.socket, secret: bytes) -> KernelEnd:
    return Channel(sock, secret, CONTROL)


def server_end(sock: socket.socket, secret: bytes) -> ServerEnd:
    return Channel(sock, secret, CONTROL, receives=ToForkServer)
