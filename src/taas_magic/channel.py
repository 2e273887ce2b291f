"""Messages between the kernel and its fork server: length-prefixed pickles over a socketpair.

The socketpair is created by the kernel and inherited by the server alone, so only those two
processes can ever speak on it: no address, no port, nothing to authenticate against.
File descriptors (the memory file holding shipped tensors) travel beside a message.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

import cloudpickle

_HEADER = struct.Struct("!QI")  # body length, number of descriptors


class ChannelClosed(EOFError):
    """The other side is gone."""


def send(sock: socket.socket, message: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    body = cloudpickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # code objects too
    header = _HEADER.pack(len(body), len(fds))
    if fds:
        socket.send_fds(sock, [header], list(fds))
    else:
        sock.sendall(header)
    sock.sendall(body)


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the descriptors that came with it; raises ChannelClosed at EOF."""
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 8)
    header += _read_exactly(sock, _HEADER.size - len(header))
    length, _ = _HEADER.unpack(header)
    return pickle.loads(_read_exactly(sock, length)), list(fds)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    if size == 0:
        return b""
    buffer = bytearray(size)
    view = memoryview(buffer)
    while view:
        count = sock.recv_into(view)
        if count == 0:
            raise ChannelClosed("the other side closed the channel")
        view = view[count:]
    return bytes(buffer)
