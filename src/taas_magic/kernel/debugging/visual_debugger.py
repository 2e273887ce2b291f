"""A taas cell's ranks as threads of the notebook's visual debugger (JupyterLab's, VS Code's).

The front end debugs the kernel over the Jupyter Debug Protocol: ``debug_request``s on the control
channel, which ipykernel's ``Debugger.process_request`` answers, and ``debug_event``s on iopub.
While a client is attached, ranks that are to be debugged connect their debugger engine (pydevd)
to a loopback port of the kernel (``rank/visual_debugging.py``), where this module speaks to each
as debugpy's adapter would: it sends the notebook's breakpoints and lets the rank run.

The front end sees one session: which rank a request is for, and each message as the other end must read it,
is decided by ``debugger_router.py``; which stopped rank the front end shows, by ``debugger_focus.py``. This
module does their I/O. Breakpoints set while ranks are connected reach them at once.

Connections are authenticated both ways with a secret of this kernel's (pydevd's access tokens),
and bound to the loopback address.
"""

from __future__ import annotations

import itertools
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from taas_magic.kernel.debugging.debugger_focus import Focus
from taas_magic.kernel.debugging.debugger_router import Message, Router, unanswered
from taas_magic.kernel.debugging.rank_engines import RankEngine, hang_up
from taas_magic.process import ipykernel_private
from taas_magic.process.kernel_debugger import hidden_thread
from taas_magic.wire.task import DebugLink

HANDSHAKE_SECONDS = 10.0
# debugpy's adapter (1.8.22 and earlier) stops accepting clients for good when one connects before it has ended
# the previous session: its accepting thread tells the oldest session's client of its sockets, that client's
# stream is closed already, and the error ends the thread. ipykernel then waits for ever for its answer to
# ``initialize``, and every later request waits behind it. Ending a session takes the adapter milliseconds
# (a busy machine: more); a client that attaches again sooner than this after detaching waits out the rest.
REATTACH_SECONDS = 1.0
# How long a cell's end waits for its ranks' connections to be seen closed: the sockets close as the processes
# end, so this is the reader threads' wake-up on a busy machine.
LEAVE_SECONDS = 2.0
# Where taas's own code is: stepping does not go into it, as ipykernel keeps stepping out of its own.
_OWN_CODE = [str(Path(__file__).resolve().parents[2] / name) for name in ("taas_magic", "taas")]


class RankDebugging:
    """The kernel's side of ranks in the visual debugger: the port they join on, and the requests and
    events between them and the front end."""

    def __init__(self, debugger: Any):
        self.debugger = debugger  # ipykernel's Debugger: its session with the front end
        self.secret = secrets.token_hex(16)
        self.listener: socket.socket | None = None
        self.ranks: list[RankEngine] = []
        self.router: Router[RankEngine] = Router()  # the front end's ids for the ranks' own, and what follows
        self.breakpoints: dict[str, Message] = {}  # the front end's setBreakpoints arguments, by source path
        self.exception_breakpoints: Message = {"filters": []}
        self.lock = threading.Lock()
        self.left = threading.Condition(self.lock)  # a rank's connection ended
        self.original: Callable[[Message], Any] | None = None
        self.event_numbers = itertools.count(1)
        self.cell_file = ""  # the file of the cell that runs now (cells run one at a time)
        self.focus = Focus(self.router.ids, self._send_event)  # which rank threads are stopped, which one is shown
        self.detached_at = -REATTACH_SECONDS  # when the client last detached (time.monotonic())

    # -- in the kernel's life --------------------------------------------------------------------
    @classmethod
    def of(cls, shell: Any) -> "RankDebugging | None":
        """For the kernel of ``shell``, if it has the notebook's debugger (None in a terminal IPython)."""
        debugger = ipykernel_private.debugger_of(shell)
        return None if debugger is None else cls(debugger)

    def install(self) -> None:
        """Stand between the front end and the kernel's debugger: requests for ranks go to them, and a
        re-attach too soon after a detach waits (``REATTACH_SECONDS``). Done as the extension loads,
        kept until it unloads."""
        if self.original is None:
            self.original = ipykernel_private.intercept(self.debugger, self.process_request)

    def uninstall(self) -> None:
        if self.original is not None:
            ipykernel_private.release(self.debugger, self.process_request, self.original)
        self.original = None
        self.close()

    def attached(self) -> bool:
        """Whether a debugging client (JupyterLab's debugger, VS Code) is attached to the kernel."""
        return ipykernel_private.attached(self.debugger)

    def link(self, ranks: frozenset[int] | None, cell_file: str) -> DebugLink:
        """How the ranks of the cell compiled as ``cell_file`` join, a client being attached: at once when
        breakpoints are set, at a ``breakpoint()`` otherwise."""
        self.cell_file = cell_file
        port = self._listen()
        eager = any(arguments.get("breakpoints") for arguments in self._breakpoints().values())
        return DebugLink(port, self.secret, secrets.token_hex(4), ranks, eager)

    def stopped_ranks(self) -> frozenset[int]:
        """The ranks stopped in the debugger now. Cells run one at a time, so they are the running cell's: its
        pump counts their time as a person's (``CellFrontEnd.stopped``)."""
        return self.focus.now.stopped_ranks()

    def sees_breakpoints(self) -> bool:
        """A client is attached and breakpoints are set (for cells whose ranks cannot join: a cluster's)."""
        return self.attached() and any(arguments.get("breakpoints") for arguments in self._breakpoints().values())

    def ranks_left(self, run: str, timeout: float = LEAVE_SECONDS) -> None:
        """The processes of ``run`` (a link's) ended: wait, ``timeout`` at most, until their connections are seen
        closed and the front end is told their threads exited, so that the cell ends after those events and not
        before (a front end would otherwise show threads of ranks that are gone)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            self.left.wait_for(lambda: all(rank.run != run for rank in self.ranks), timeout)
        self.focus.settle(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """The client detached: stopped ranks go on, untraced; no rank joins any more."""
        listener, self.listener = self.listener, None
        if listener is not None:
            hang_up(listener)  # its accepting thread ends
        with self.lock:
            ranks, self.ranks = self.ranks, []
            self.left.notify_all()
        for rank in ranks:
            rank.send("disconnect", {"restart": False, "terminateDebuggee": False})
            rank.close()
            self.focus.rank_dropped(rank)  # no longer stopped here; the client that would be told is gone
        self.focus.forget_the_next_show()
        self.breakpoints.clear()

    # -- requests from the front end ---------------------------------------------------------------
    async def process_request(self, message: Message) -> Message:
        assert self.original is not None
        arguments = message.get("arguments") or {}
        if message["command"] == "continue" and self._continues_the_shown_rank(arguments):
            arguments = message["arguments"] = {**arguments, "threadId": self.focus.now.shown}
        owner = self.router.owner(arguments)
        if owner is not None:
            answered: Message = await _in_thread(lambda: self._for_rank(owner, message))
            return answered
        command = message["command"]
        if command == "disconnect":
            self.close()
        elif command == "initialize" and not self.attached():
            await _sleep(self.detached_at + REATTACH_SECONDS - time.monotonic())
        elif command == "setBreakpoints":
            self.breakpoints[arguments["source"]["path"]] = arguments
        elif command == "setExceptionBreakpoints":
            self.exception_breakpoints = arguments
        reply: Message = await self.original(message)
        if command == "disconnect":
            self.detached_at = time.monotonic()
        elif command == "threads" and reply.get("success"):
            reply["body"]["threads"] += await _in_thread(self._threads)
        elif command in ("setBreakpoints", "setExceptionBreakpoints"):
            for rank in self._connected():
                rank.send(command, arguments)
        elif command == "debugInfo" and reply.get("success"):
            reply["body"]["stoppedThreads"] += self.focus.now.stopped_threads()
        return reply

    def _continues_the_shown_rank(self, arguments: Message) -> bool:
        kernel_stopped = ipykernel_private.stopped_threads(self.debugger)
        return self.router.continues_the_shown_rank(arguments, kernel_stopped, self.focus.now.shown)

    def _for_rank(self, rank: RankEngine, message: Message) -> Message:
        """A request about a rank's thread, frame or variable, answered by that rank."""
        if message["command"] == "richInspectVariables":
            return self._rich(rank, message)
        command, arguments = self.router.request(message)
        try:
            answer = rank.request(command, arguments)
        except (ConnectionError, TimeoutError) as e:
            answer = unanswered(rank, command, e)
        accept = ipykernel_private.variable_filter(self.debugger)
        return self.router.reply(rank, answer, message, self.cell_file, accept)

    def _rich(self, rank: RankEngine, message: Message) -> Message:
        """A variable's rich display, formatted in the rank as the notebook would format it."""
        evaluation = self.router.rich_request(message)
        answer = None
        if evaluation is not None:
            try:
                answer = rank.request("evaluate", evaluation)
            except (ConnectionError, TimeoutError):
                pass  # shown as no display
        return self.router.rich_reply(message, answer)

    def _threads(self) -> list[Message]:
        """Every connected rank's threads, named after the rank."""
        threads = []
        for rank in self._connected():
            try:
                threads += self.router.threads(rank, rank.request("threads", {}, timeout=2.0))
            except (ConnectionError, TimeoutError):
                continue
        return threads

    def _connected(self) -> list[RankEngine]:
        with self.lock:
            return list(self.ranks)

    # -- ranks joining, and their events -----------------------------------------------------------
    def _listen(self) -> int:
        if self.listener is None:
            listener = socket.create_server(("127.0.0.1", 0))
            self.listener = listener
            hidden_thread(self._accept, listener, name="taas-debugger-ranks")
        return int(self.listener.getsockname()[1])

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return  # closed: the client detached
            hidden_thread(self._welcome, connection, name="taas-debugger-rank")

    def _welcome(self, connection: socket.socket) -> None:
        """A rank connected: check that it is one of ours, give it the breakpoints, let it run."""
        rank = RankEngine(connection, self.focus.rank_event, self._gone)
        try:
            reply = rank.request("pydevdAuthorize", {"debugServerAccessToken": self.secret}, HANDSHAKE_SECONDS)
            secret, run, number = str(reply.get("body", {}).get("clientAccessToken", "")).split(":")
            if not secrets.compare_digest(secret, self.secret) or self.listener is None:
                raise ConnectionError("not a rank of this kernel's")
            rank.name(run, int(number))
            rank.request(
                "initialize",
                {
                    "adapterID": "python",
                    "clientID": "taas",
                    "pathFormat": "path",
                    "linesStartAt1": True,
                    "columnsStartAt1": True,
                },
                HANDSHAKE_SECONDS,
            )
            rank.request("attach", self._attach_options(), HANDSHAKE_SECONDS)
            for arguments in self._breakpoints().values():
                rank.request("setBreakpoints", arguments, HANDSHAKE_SECONDS)
            rank.request("setExceptionBreakpoints", self.exception_breakpoints, HANDSHAKE_SECONDS)
            with self.lock:
                self.ranks.append(rank)
            rank.request("configurationDone", {}, HANDSHAKE_SECONDS)
        except (ConnectionError, TimeoutError, ValueError, OSError):
            rank.close()  # a probe of the port, a stranger, or a rank that went away

    def _attach_options(self) -> Message:
        options: Message = {
            "justMyCode": ipykernel_private.just_my_code(self.debugger),
            "rules": [{"path": path, "include": False} for path in _OWN_CODE],
        }
        if not options["justMyCode"]:
            options["debugOptions"] = ["DebugStdLib"]
        return options

    def _breakpoints(self) -> dict[str, Message]:
        """The notebook's breakpoints: as the front end set them here, else as the kernel's debugger kept them."""
        kept = ipykernel_private.kept_breakpoints(self.debugger)
        known = {path: {"source": {"path": path}, "breakpoints": lines} for path, lines in kept.items()}
        return {**known, **self.breakpoints}

    def _gone(self, rank: RankEngine) -> None:
        """The rank's connection ended (it exited, or was stopped): its threads leave the session."""
        with self.lock:
            if rank not in self.ranks:
                return
            self.ranks.remove(rank)
            self.focus.rank_gone(rank)
            self.left.notify_all()

    def _send_event(self, kind: str, body: Message) -> None:
        """A debug event to the front end (from the focus thread alone)."""
        event = {"type": "event", "event": kind, "body": body, "seq": next(self.event_numbers)}
        ipykernel_private.send_event(self.debugger, event)


async def _sleep(seconds: float) -> None:
    """Wait on the kernel's control loop without blocking it: debugpy's messages are read on it meanwhile."""
    if seconds > 0:
        import anyio

        await anyio.sleep(seconds)


async def _in_thread(work: Callable[[], Any]) -> Any:
    """``work`` (which waits for ranks) off the kernel's control loop, which must keep serving interrupts."""
    import anyio.to_thread

    return await anyio.to_thread.run_sync(work)
