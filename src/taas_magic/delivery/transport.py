"""One element (a batch) from a producer to a rank, without its tensor data passing through a pipe.

The producer writes the element into an anonymous memory file — a small pickle whose tensors
are references into the same file, then the tensors' bytes — and sends the file's descriptor
over a SOCK_SEQPACKET socketpair. Each message is delivered whole, so several producers can
share one rank's socket without a lock. The rank maps the file copy-on-write (a small one it
reads) and its tensors view that memory directly; when the last of them is gone, so is the
memory. The rank closes the descriptor at once, so a rank that keeps every batch it received
holds no more descriptors than one that keeps none. Nothing has a name, listens, or outlives
the processes holding it.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import struct
from typing import Any

from taas_magic.errors import ProducersGone
from taas_magic.wire import beside, memfile, sparse_rebuilds

_HEADER = struct.Struct("!qqQ")  # pass number, element index, pickle length
_FD = struct.Struct("i")  # a descriptor in SCM_RIGHTS data


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(producers' end, rank's end) of one rank's channel."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class _Encoder(pickle.Pickler):
    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.beside = beside.FileTensors()

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if type(obj) is torch.Tensor and obj.device.type == "cpu" and memfile.carries(obj):
            return self.beside.reduce(obj)
        return NotImplemented


def send(sock: socket.socket, pass_number: int, index: int, element: Any) -> None:
    """Write ``element`` into a new memory file and send its descriptor."""
    buffer = io.BytesIO()
    encoder = _Encoder(buffer)
    encoder.dump(element)
    skeleton = buffer.getvalue()
    data_start = memfile.aligned(len(skeleton))
    fd = memfile.new_file("taas-element", data_start + encoder.beside.size)
    try:
        memfile.write_bytes(fd, skeleton)
        encoder.beside.write(fd, data_start)
        socket.send_fds(sock, [_HEADER.pack(pass_number, index, len(skeleton))], [fd])
    finally:
        os.close(fd)


def receive(sock: socket.socket) -> tuple[int, int, Any]:
    """The next element on the rank's channel: (pass number, index, element)."""
    return _element(*_next_message(sock, 0))


def receive_if_waiting(sock: socket.socket) -> tuple[int, int, Any] | None:
    """The next element if one is waiting already, else None."""
    try:
        message = _next_message(sock, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    return _element(*message)


def discard_waiting(sock: socket.socket) -> int:
    """Throw away every element waiting on the rank's channel, unread; returns how many there were."""
    count = 0
    while True:
        try:
            header, fds = _next_message(sock, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return count
        for fd in fds:
            os.close(fd)
        if not header:
            return count
        count += 1


# -- relaying between machines (a cluster node's agent): elements as files, never unpickled --------
def take_waiting_file(sock: socket.socket) -> tuple[bytes, int] | None:
    """The next element waiting on a channel, as (header, its memory file: the caller closes it),
    without waiting; ``(b"", -1)`` once every sender has closed the channel; None when nothing
    waits yet."""
    try:
        header, fds = _next_message(sock, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    if not header:
        for fd in fds:
            os.close(fd)
        return b"", -1
    for fd in fds[1:]:
        os.close(fd)
    return header, fds[0]


def put_file(sock: socket.socket, header: bytes, fd: int) -> None:
    """Pass an element's memory file (from ``take_waiting_file`` on another machine, copied) into a
    local channel; the caller still closes ``fd``. A full non-blocking channel raises BlockingIOError."""
    socket.send_fds(sock, [header], [fd])


def _next_message(sock: socket.socket, flags: int) -> tuple[bytes, list[int]]:
    """One datagram and the descriptors it carries (recvmsg itself: recv_fds ignores flags before 3.12)."""
    header, ancillary, _, _ = sock.recvmsg(_HEADER.size, socket.CMSG_LEN(_FD.size), flags)
    fds = [
        fd
        for level, kind, data in ancillary
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
        for (fd,) in _FD.iter_unpack(data[: len(data) - len(data) % _FD.size])
    ]
    return header, fds


def _element(header: bytes, fds: list[int]) -> tuple[int, int, Any]:
    if not header:
        raise ProducersGone()
    pass_number, index, skeleton_length = _HEADER.unpack(header)
    try:
        memory = memfile.map_private(fds[0])
    finally:
        for fd in fds:
            os.close(fd)
    skeleton = io.BytesIO(memoryview(memory[:skeleton_length].numpy()))
    with sparse_rebuilds.forgotten():
        element = beside.Unpickler(skeleton, beside.FileReader(memory, memfile.aligned(skeleton_length))).load()
    return pass_number, index, element
