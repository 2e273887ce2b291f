"""A rank's debugger engine (pydevd), connected to the kernel: Debug Adapter Protocol messages over a socket,
and the ids in them made the front end's.

The engine speaks as debugpy's adapter expects: each message a ``Content-Length`` header and a JSON body.
Its requests are answered from a thread of its own, whether the rank runs or is stopped, so the kernel
waits for an answer with a timeout only. Each rank numbers its threads, frames and variables from 1; the
ids the front end sees are numbers of the kernel's, from ``RANK_IDS`` on, each standing for one rank's own.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterator

from taas_magic.process.kernel_debugger import hidden_thread

Message = dict[str, Any]

RANK_IDS = 1 << 28  # ids given to ranks' threads, frames and variables start here: the kernel's are small counters
ANSWER_SECONDS = 30.0  # a rank's engine answers from a thread of its own, stopped or running
ID_KEYS = {"threadId": "threads", "frameId": "frames", "srcFrameId": "frames", "variablesReference": "variables"}
_LISTS_OF_IDS = {"threads": "threads", "stackFrames": "frames"}  # lists whose items' "id" is of that kind


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


class Ids:
    """Ids of one kind as the front end sees them, each standing for one rank's own."""

    def __init__(self) -> None:
        self.numbers = itertools.count(RANK_IDS)
        self.theirs: dict[int, tuple[RankEngine, int]] = {}
        self.ours: dict[tuple[int, int], int] = {}  # (id of the rank's connection, its id) -> ours
        self.lock = threading.Lock()

    def outward(self, rank: RankEngine, number: int) -> int:
        if number <= 0:
            return number  # 0: no variables to expand
        with self.lock:
            key = (id(rank), number)
            if key not in self.ours:
                self.ours[key] = next(self.numbers)
                self.theirs[self.ours[key]] = (rank, number)
            return self.ours[key]

    def inward(self, number: int) -> tuple[RankEngine, int] | None:
        with self.lock:
            return self.theirs.get(number)

    def of(self, rank: RankEngine) -> list[int]:
        with self.lock:
            return [ours for ours, (owner, _) in self.theirs.items() if owner is rank]

    def forget(self, rank: RankEngine) -> None:
        with self.lock:
            for ours in [ours for ours, (owner, _) in self.theirs.items() if owner is rank]:
                _, theirs = self.theirs.pop(ours)
                self.ours.pop((id(rank), theirs), None)


def translate(value: Any, swap: Callable[[str, int], int], kind_of_id: str | None = None) -> Any:
    """``value`` with each thread, frame and variable id in it swapped (``swap(kind, id)``)."""
    if isinstance(value, list):
        return [translate(item, swap, kind_of_id) for item in value]
    if not isinstance(value, dict):
        return value
    swapped: dict[str, Any] = {}
    for key, item in value.items():
        if key in ID_KEYS and isinstance(item, int):
            swapped[key] = swap(ID_KEYS[key], item)
        elif key == "id" and kind_of_id is not None and isinstance(item, int):
            swapped[key] = swap(kind_of_id, item)
        elif key in _LISTS_OF_IDS and isinstance(item, list):
            swapped[key] = [translate(entry, swap, _LISTS_OF_IDS[key]) for entry in item]
        else:
            swapped[key] = translate(item, swap)
    return swapped


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
