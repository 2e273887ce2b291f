"""The stream between two nodes' agents that carries a loader's elements to the ranks of another node.

One TCP connection per (loader, node of ranks, node of producers), opened by the node of ranks
to the address and port its host's agent names through Ray, authenticated both ways before
anything else passes: each side proves it holds the run's secret (an HMAC over the other's
fresh nonce, the node of ranks first, so a stranger learns nothing), so nothing that lacks it
can feed a rank a pickle or read one. The proof is made once per connection, as
``multiprocessing.connection`` does, not per message: tagging a gigabyte a second would cost a
core. The stream is not encrypted; like Ray's own traffic it belongs on the cluster's network.
The host listens on loopback when the only node that reads from it is itself (elsewhere on the
node's address), and only for the run.

    host ──► node of ranks:  FRAME (rank, header length, data length), the element's header, its bytes
                             (header length 0: this host sends that rank nothing more)
    node of ranks ──► host:  its counters, whole, each time they change (a size fixed by the run)

An element's bytes are its memory file's as the producer wrote it: the host hands the file to
the socket (``sendfile``) and the node of ranks moves them from the socket into a new memory file
of its own (``splice``), which goes to the rank as on one machine: neither passes them through
user space. That is one copy more than on one machine, the least a second machine needs.
Neither side unpickles anything here.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import select
import socket
import struct
import threading
from typing import Callable

from taas_magic.wire import memfile

FRAME = struct.Struct("!iIQ")  # rank, header length (0: that rank's last), data length
_HELLO = struct.Struct("!II")  # loader number, how many ranks follow (each "!i")
_RANK = struct.Struct("!i")
_NONCE = 32
HANDSHAKE_SECONDS = 10.0  # a peer that has not proved itself this soon is dropped
CHUNK = 1024 * 1024  # bytes read from the socket at a time, then written into the element's file
ELEMENTS_AT_ONCE = 8  # per rank and turn of a host's loop, so that no rank starves the others


class RelayBroken(ConnectionError):
    """The other node's end is gone, or could not prove it holds the run's secret."""


def _proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = sock.recv(size, socket.MSG_WAITALL) if size else b""
    if len(data) != size:
        raise RelayBroken(f"the stream ended after {len(data)} of {size} bytes")
    return data


def _challenge(sock: socket.socket, secret: bytes) -> None:
    """The host's side: the node of ranks proves itself first, so a stranger learns nothing."""
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(nonce)
    answer = _exactly(sock, 32 + _NONCE)
    if not hmac.compare_digest(answer[:32], _proof(secret, b"ranks", nonce)):
        raise RelayBroken("the other end does not hold this run's secret")
    sock.sendall(_proof(secret, b"host", answer[32:]))


def _answer(sock: socket.socket, secret: bytes) -> None:
    """The node of ranks' side; the roles are in the proofs, so one is never good the other way."""
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(_proof(secret, b"ranks", _exactly(sock, _NONCE)) + nonce)
    if not hmac.compare_digest(_exactly(sock, 32), _proof(secret, b"host", nonce)):
        raise RelayBroken("the host does not hold this run's secret")


# -- the node of ranks ---------------------------------------------------------------------------
def connect(address: str, port: int, secret: bytes, number: int, ranks: tuple[int, ...]) -> socket.socket:
    """A proven stream from the host at ``address:port`` carrying loader ``number``'s elements for ``ranks``."""
    sock = socket.create_connection((address, port), timeout=HANDSHAKE_SECONDS)
    try:
        _answer(sock, secret)
        sock.sendall(_HELLO.pack(number, len(ranks)) + b"".join(_RANK.pack(rank) for rank in ranks))
        sock.settimeout(None)  # from now on a stalled host is found by Ray and the run ended
    except BaseException:
        sock.close()
        raise
    return sock


class Reader:
    """Reads elements' bytes from a stream into memory files: on Linux moved by the system from the
    socket through a pipe into the file (``splice``: no pass through user space, about a fifth less
    CPU than reading into a buffer and writing it out), elsewhere through a reused buffer."""

    def __init__(self) -> None:
        self.pipe: tuple[int, int] | None = None
        self.buffer = memoryview(bytearray(CHUNK))
        if hasattr(os, "splice"):
            self.pipe = os.pipe()
            try:
                import fcntl

                fcntl.fcntl(self.pipe[1], getattr(fcntl, "F_SETPIPE_SZ", 1031), CHUNK)
            except OSError:
                pass  # a smaller pipe moves the same bytes in more steps

    def receive(self, sock: socket.socket) -> tuple[int, bytes, int]:
        """The next frame: (rank, the element's header, a new memory file holding its bytes), or
        (rank, b"", -1) when the host sends that rank nothing more. The caller owns the file."""
        rank, header_length, size = FRAME.unpack(_exactly(sock, FRAME.size))
        if not header_length:
            return rank, b"", -1
        header = _exactly(sock, header_length)
        fd = memfile.new_file("taas-element", size)
        try:
            (self._splice if self.pipe is not None else self._copy)(sock, fd, size)
        except BaseException:
            os.close(fd)
            raise
        return rank, header, fd

    def _splice(self, sock: socket.socket, fd: int, size: int) -> None:
        assert self.pipe is not None
        done = 0
        while done < size:
            moved = os.splice(sock.fileno(), self.pipe[1], min(CHUNK, size - done))
            if not moved:
                raise RelayBroken(f"the stream ended within an element, after {done} of {size} bytes")
            while moved:
                written = os.splice(self.pipe[0], fd, moved, offset_dst=done)
                done += written
                moved -= written

    def _copy(self, sock: socket.socket, fd: int, size: int) -> None:
        buffer, done = self.buffer, 0
        while done < size:
            got = sock.recv_into(buffer, min(len(buffer), size - done))
            if not got:
                raise RelayBroken(f"the stream ended within an element, after {done} of {size} bytes")
            written = 0
            while written < got:
                written += os.pwrite(fd, buffer[written:got], done + written)
            done += got

    def close(self) -> None:
        if self.pipe is not None:
            for end in self.pipe:
                os.close(end)
            self.pipe = None


class Snapshots:
    """The newest counters for one host, sent without ever blocking the thread that feeds the ranks:
    one begun is finished first, and of those offered meanwhile only the newest follows."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.pending = memoryview(b"")  # begun, or about to be
        self.newest: bytes | None = None

    def offer(self, snapshot: bytes) -> None:
        self.newest = snapshot

    def flush(self) -> bool:
        """Send what the socket takes now; whether everything offered has gone."""
        while True:
            if not self.pending:
                if self.newest is None:
                    return True
                self.pending, self.newest = memoryview(self.newest), None
            try:
                sent = self.sock.send(self.pending, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            self.pending = self.pending[sent:]


def snapshot_bytes(values: list[int]) -> bytes:
    return struct.pack(f"!{len(values)}q", *values)


# -- the host -------------------------------------------------------------------------------------
class Listener:
    """A host's end: accepts proven streams for the run, and hands each to ``serve(sock, number,
    ranks)`` in a thread of its own until ``close``."""

    def __init__(self, address: str, secret: bytes, serve: Callable[[socket.socket, int, tuple[int, ...]], None]):
        self.sock = socket.create_server((address, 0))
        self.address = address
        self.port: int = self.sock.getsockname()[1]
        self.secret = secret
        self.serve = serve
        self.stopped = threading.Event()
        self.streams: list[socket.socket] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._accept, name="taas-relay-accept", daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            if not select.select([self.sock], [], [], 0.1)[0]:
                continue
            try:
                sock, _ = self.sock.accept()
            except OSError:
                continue  # closed meanwhile, or the peer gave up
            with self.lock:
                if self.stopped.is_set():
                    sock.close()
                    return
                self.streams.append(sock)
                thread = threading.Thread(target=self._stream, args=(sock,), name="taas-relay-out", daemon=True)
                self.threads.append(thread)
            thread.start()

    def _stream(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            _challenge(sock, self.secret)
            number, count = _HELLO.unpack(_exactly(sock, _HELLO.size))
            ranks = tuple(_RANK.unpack(_exactly(sock, _RANK.size))[0] for _ in range(min(count, 1 << 16)))
            sock.settimeout(None)
        except (OSError, ConnectionError):
            sock.close()  # a stranger, or a node of ranks that went away: nothing was sent
            return
        try:
            self.serve(sock, number, ranks)
        except OSError:
            pass  # the node of ranks went away; the kernel hears of it from Ray
        finally:
            sock.close()

    def close(self) -> None:
        """Stop accepting, and end every stream (a thread blocked sending to a stuck node wakes)."""
        with self.lock:
            self.stopped.set()
            for sock in self.streams:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(2.0)
        self.sock.close()


def send_element(sock: socket.socket, rank: int, header: bytes, fd: int) -> None:
    """One element's frame, its bytes handed from its memory file to the socket by the system."""
    size = os.fstat(fd).st_size
    sock.sendall(FRAME.pack(rank, len(header), size) + header)
    sent = 0
    while sent < size:
        sent += os.sendfile(sock.fileno(), fd, sent, size - sent)


def send_last(sock: socket.socket, rank: int) -> None:
    sock.sendall(FRAME.pack(rank, 0, 0))


class Incoming:
    """Snapshots arriving from a node of ranks, read without blocking; the newest whole one wins."""

    def __init__(self, sock: socket.socket, size: int):
        self.sock = sock
        self.size = size
        self.data = bytearray()

    def read(self) -> tuple[list[int] | None, bool]:
        """(the newest whole snapshot that arrived, or None; whether the node of ranks has finished)."""
        try:
            chunk = self.sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None, False
        if not chunk:
            return None, True
        self.data += chunk
        whole = len(self.data) // self.size * self.size
        if not whole:
            return None, False
        newest = bytes(self.data[whole - self.size : whole])
        del self.data[:whole]
        return list(struct.unpack(f"!{self.size // 8}q", newest)), False
