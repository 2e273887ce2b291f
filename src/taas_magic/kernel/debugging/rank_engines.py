"""A rank's debugger engine (pydevd), connected to the kernel: Debug Adapter Protocol messages over a socket.

The engine speaks as debugpy's adapter expects: each message a ``Content-Length`` header and a JSON body.
Its requests are answered from a thread of its own, whether the rank runs or is stopped, so the kernel
waits for an answer with a timeout only. The messages carry the rank's own ids; ``debugger_router.py``
gives them the front end's numbers.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
from concurrent.futures import Future
from typing import Callable, Iterator

from taas_magic.kernel.debugging.debugger_router import Message
from taas_magic.process.kernel_debugger import hidden_thread

ANSWER_SECONDS = 30.0  # a rank's engine answers from a thread of its own, stopped or running


class RankEngine:
    """One rank's debugger engine, connected: requests and their answers, events as they come."""

    def __init__(
        self,
        connection: socket.socket,
        on_event: Callable[["RankEngine", Message], None],
        on_gone: Callable[["RankEngine"], None],
    ):
        self.connection = connection
        self.on_event = on_event
        self.on_gone = on_gone
        self.run, self.number, self.label = "", -1, "a rank"
        self.waiting: dict[int, Future[Message]] = {}
        self.numbers = itertools.count(1)
        self.send_lock = threading.Lock()
        self.joined = False
        hidden_thread(self._read, name="taas-debugger-rank-reader")

    def name(self, run: str, number: int) -> None:
        self.run, self.number, self.label = run, number, f"rank {number}"
        self.joined = True

    def request(self, command: str, arguments: Message, timeout: float = ANSWER_SECONDS) -> Message:
        answer = self.send(command, arguments)
        try:
            return answer.result(timeout)
        except TimeoutError:
            raise TimeoutError(f"no answer to {command} within {timeout:.0f} s") from None

    def send(self, command: str, arguments: Message) -> Future[Message]:
        answer: Future[Message] = Future()
        with self.send_lock:
            number = next(self.numbers)
            self.waiting[number] = answer
            body = json.dumps({"seq": number, "type": "request", "command": command, "arguments": arguments}).encode()
            try:
                self.connection.sendall(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError as e:
                self.waiting.pop(number, None)
                answer.set_exception(ConnectionError(str(e)))
        return answer

    def close(self) -> None:
        hang_up(self.connection)

    def _read(self) -> None:
        try:
            for message in dap_messages(self.connection):
                if message.get("type") == "response":
                    answer = self.waiting.pop(message.get("request_seq", -1), None)
                    if answer is not None:
                        answer.set_result(message)
                elif message.get("type") == "event" and self.joined:
                    self.on_event(self, message)
        except (OSError, ValueError):
            pass  # the connection broke off: as at its end
        finally:
            for answer in list(self.waiting.values()):
                if not answer.done():
                    answer.set_exception(ConnectionError(f"{self.label} left the debugger"))
            self.waiting.clear()
            if self.joined:
                self.on_gone(self)


def hang_up(connection: socket.socket) -> None:
    """Close ``connection`` for every process that holds it (forked ranks inherit the kernel's sockets), so
    that a thread of this one waiting on it (in ``accept`` or ``recv``) wakes; ``close`` alone leaves it waiting."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or gone already
    connection.close()


def dap_messages(connection: socket.socket) -> Iterator[Message]:
    """The messages a debugger engine sends: each a ``Content-Length`` header and a JSON body."""
    stream = connection.makefile("rb")
    while True:
        length = None
        while True:
            line = stream.readline()
            if not line:
                return
            if line in (b"\r\n", b"\n"):
                break
            name, _, number = line.decode("ascii", "replace").partition(":")
            if name.strip().lower() == "content-length":
                length = int(number)
        if length is None:
            return
        body = stream.read(length)
        if len(body) < length:
            return
        yield json.loads(body)
