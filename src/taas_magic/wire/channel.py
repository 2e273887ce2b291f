"""Authenticated messages between two taas processes over a SOCK_SEQPACKET socketpair.

A message is one datagram, so it is sent whole or not at all: an interrupt can land before or
after a send, never in the middle, and the two sides can never disagree about where a message
begins. Bodies too large for one datagram travel in an anonymous memory file whose descriptor
goes with the datagram. Every datagram carries a sequence number and an HMAC-SHA256 tag over
everything it says, so a process that holds the socket without knowing the channel's secret
(a rank's stray descendant, say) cannot inject anything, and nothing is ever replayed.
Receivers drop nothing silently: a bad tag, a stale sequence number or a message of another
run marks the channel broken, and its owner then ends whatever depended on it.

A channel is typed by its protocol: ``Channel[Sends, Receives]`` sends only the messages of one
direction and receives only those of the other (frozen dataclasses, in ``supervision.py``,
``fork_server.py`` and ``rank_control.py``); each protocol module makes its ends. A message of any
other class that arrives, however well authenticated, breaks the channel too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import select
import socket
import struct
from typing import Generic, TypeVar, get_args

from taas_magic.wire import memfile, pickler

INLINE_LIMIT = 60_000  # bytes of pickle sent in the datagram itself; larger bodies go in a memory file
_TAG_SIZE = 32
_HEADER = struct.Struct("!QQB")  # sequence number, body length, body in a memory file (1) or inline (0)
MAX_FDS = 250  # descriptors one message may carry (the system's limit is 253): a cluster node's data channels


class ChannelBroken(ConnectionError):
    """The other side is gone, or sent something this side cannot trust."""


Sends = TypeVar("Sends")
Receives = TypeVar("Receives")


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """Two connected ends; neither has a name or an address, and neither survives an exec."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def kind_of(message: object) -> str:
    """What taas calls a message in what it says about it: the protocol's word for it, else its class."""
    kind = getattr(type(message), "kind", None)
    return kind if isinstance(kind, str) else type(message).__name__


class Channel(Generic[Sends, Receives]):
    """One end of a channel: ``send`` and ``receive`` whole messages tagged with ``run_id``.

    ``receives``: the classes of the messages this end takes (a ``Union`` of them, or one class), as
    ``Receives`` says; the protocol modules' functions that make each end keep the two the same.
    """

    def __init__(self, sock: socket.socket, secret: bytes, run_id: str, receives: object = ()):
        self.sock = sock
        self.run_id = run_id
        self._secret = secret
        self._sent = 0
        self._received = 0
        self._receives: tuple[type, ...] = get_args(receives) or ((receives,) if isinstance(receives, type) else ())

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    # -- sending ----------------------------------------------------------------------------
    def send(self, message: Sends, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send ``message`` with ``fds``; raises ChannelBroken if the other side is gone."""
        body = pickler.dumps((self.run_id, message))
        self._sent += 1  # before sending: an interrupted send leaves a gap, never a repeated number
        header = _HEADER.pack(self._sent, len(body), len(body) > INLINE_LIMIT)
        carried = list(fds)
        if len(carried) >= MAX_FDS:
            raise ValueError(f"{len(carried)} descriptors in one message: at most {MAX_FDS - 1}")
        body_file = None
        if len(body) > INLINE_LIMIT:
            body_file = memfile.new_file("taas-message", len(body))
            memfile.write_bytes(body_file, body)
            carried.append(body_file)
            payload = header
        else:
            payload = header + body
        tag = self._tag(header, body)
        try:
            socket.send_fds(self.sock, [tag + payload], carried) if carried else self.sock.sendall(tag + payload)
        except OSError as e:
            raise ChannelBroken(f"could not send {kind_of(message)!r}: {e}") from e
        finally:
            if body_file is not None:
                os.close(body_file)

    # -- receiving --------------------------------------------------------------------------
    def ready(self, timeout: float) -> bool:
        return bool(select.select([self.sock], [], [], timeout)[0])

    def receive(self) -> tuple[Receives, list[int]]:
        """The next message and the descriptors that came with it; blocks until one arrives."""
        try:
            datagram, fds, flags = self._receive_datagram()
        except OSError as e:
            raise ChannelBroken(f"the channel failed: {e}") from e
        try:
            return self._open(datagram, fds, flags)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _receive_datagram(self) -> tuple[bytes, list[int], int]:
        size = _TAG_SIZE + _HEADER.size + INLINE_LIMIT
        try:
            datagram, fds, flags, _ = socket.recv_fds(self.sock, size, MAX_FDS)
        except ConnectionResetError:
            # The other side closed before reading all we sent (a request that crossed its last
            # words). The system says so once; what it sent before closing is still there to read.
            datagram, fds, flags, _ = socket.recv_fds(self.sock, size, MAX_FDS)
        return datagram, fds, flags

    def _open(self, datagram: bytes, fds: list[int], flags: int) -> tuple[Receives, list[int]]:
        if not datagram:
            raise ChannelBroken("the other side closed the channel")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(datagram) < _TAG_SIZE + _HEADER.size:
            raise ChannelBroken("a malformed message arrived")
        tag, header = datagram[:_TAG_SIZE], datagram[_TAG_SIZE : _TAG_SIZE + _HEADER.size]
        sequence, length, in_file = _HEADER.unpack(header)
        if in_file:
            if not fds:
                raise ChannelBroken("a message announced a body it did not carry")
            body_file = fds.pop()
            try:
                body = memfile.read_bytes(body_file, length)
            finally:
                os.close(body_file)
        else:
            body = datagram[_TAG_SIZE + _HEADER.size :]
        if len(body) != length or not hmac.compare_digest(tag, self._tag(header, body)):
            raise ChannelBroken("a message failed authentication")
        if sequence <= self._received:
            raise ChannelBroken(f"message {sequence} arrived after message {self._received}")
        self._received = sequence
        run_id, message = pickle.loads(body)
        if run_id != self.run_id:
            raise ChannelBroken(f"a message of run {run_id!r} arrived on the channel of run {self.run_id!r}")
        if not self._takes(message):
            raise ChannelBroken(f"unexpected message {kind_of(message)!r}")
        received: Receives = message
        return received, fds

    def _takes(self, message: object) -> bool:
        return isinstance(message, self._receives)

    def _tag(self, header: bytes, body: bytes) -> bytes:
        """HMAC-SHA256 of the header and body: processors compute SHA-256 in hardware, at about twice the
        speed of BLAKE2b here, and a large body (a session's results, shipped names) is hashed on every hop."""
        digest = hmac.new(self._secret, header, hashlib.sha256)
        digest.update(body)
        return digest.digest()
