"""A taas cell's ranks as threads of the notebook's visual debugger (JupyterLab's, VS Code's).

The front end debugs the kernel over the Jupyter Debug Protocol: ``debug_request``s on the control
channel, which ipykernel's ``Debugger.process_request`` answers, and ``debug_event``s on iopub.
While a client is attached, ranks that are to be debugged connect their debugger engine (pydevd)
to a loopback port of the kernel (``rank/visual_debugging.py``), where this module speaks to each
as debugpy's adapter would: it sends the notebook's breakpoints and lets the rank run.

The front end sees one session. Each rank numbers its threads, frames and variables from 1, as the
kernel's own debugger does, so every id a rank sends is given a number of its own here, in a range
the kernel's never reaches, and a request that names such an id goes to that rank with the rank's
own id. A rank's main thread is ``rank N``, its other threads ``rank N: name``. Breakpoints set
while ranks are connected reach them at once.

Connections are authenticated both ways with a secret of this kernel's (pydevd's access tokens),
and bound to the loopback address.
"""

from __future__ import annotations

import ast
import itertools
import secrets
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from taas_magic.kernel.debugger_focus import Focus
from taas_magic.kernel.rank_engines import ID_KEYS, RANK_IDS, Ids, Message, RankEngine, hang_up, translate
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
GOING_ON = ("continue", "next", "stepIn", "stepOut")  # requests that let a stopped thread run
# Where taas's own code is: stepping does not go into it, as ipykernel keeps stepping out of its own.
_OWN_CODE = [str(Path(__file__).resolve().parents[2] / name) for name in ("taas_magic", "taas")]
_OWN_THREADS = "taas-"  # taas's threads in a rank (its lifeline, its samplers): not the user's to debug
_RICH = "__import__('taas_magic.rank.visual_debugging', fromlist=['rich']).rich({name})"


_installed: "RankDebugging | None" = None  # the one installed in this kernel


def stopped_ranks() -> frozenset[int]:
    """The ranks of the running cell stopped in the notebook's visual debugger now."""
    return frozenset() if _installed is None else _installed.stopped_ranks()


class RankDebugging:
    """The kernel's side of ranks in the visual debugger: the port they join on, and the requests and
    events between them and the front end."""

    def __init__(self, debugger: Any):
        self.debugger = debugger  # ipykernel's Debugger: its session with the front end
        self.secret = secrets.token_hex(16)
        self.listener: socket.socket | None = None
        self.ranks: list[RankEngine] = []
        self.ids = {kind: Ids() for kind in ("threads", "frames", "variables")}
        self.breakpoints: dict[str, Message] = {}  # the front end's setBreakpoints arguments, by source path
        self.exception_breakpoints: Message = {"filters": []}
        self.lock = threading.Lock()
        self.original: Callable[[Message], Any] | None = None
        self.event_numbers = itertools.count(1)
        self.cell_file = ""  # the file of the cell that runs now (cells run one at a time)
        self.focus = Focus(self.ids, self._send_event)  # which rank threads are stopped, which one is shown
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
        global _installed
        if self.original is None:
            self.original = ipykernel_private.intercept(self.debugger, self.process_request)
        _installed = self

    def uninstall(self) -> None:
        global _installed
        if self.original is not None:
            ipykernel_private.release(self.debugger, self.process_request, self.original)
        self.original = None
        _installed = None if _installed is self else _installed
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
        """The ranks stopped in the debugger now. Cells run one at a time, so they are the running cell's."""
        return self.focus.now.stopped_ranks()

    def sees_breakpoints(self) -> bool:
        """A client is attached and breakpoints are set (for cells whose ranks cannot join: a cluster's)."""
        return self.attached() and any(arguments.get("breakpoints") for arguments in self._breakpoints().values())

    def close(self) -> None:
        """The client detached: stopped ranks go on, untraced; no rank joins any more."""
        listener, self.listener = self.listener, None
        if listener is not None:
            hang_up(listener)  # its accepting thread ends
        with self.lock:
            ranks, self.ranks = self.ranks, []
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
        owner = self._owner(arguments)
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
            reply["body"]["stoppedThreads"] += self._stopped_threads()
        return reply

    def _continues_the_shown_rank(self, arguments: Message) -> bool:
        """Whether a ``continue`` meant for no stopped thread of the kernel's is for the rank the front end
        shows: JupyterLab forgets the thread it shows before it sends ``continue``, and names thread 1."""
        thread = arguments.get("threadId")
        kernel_stopped = ipykernel_private.stopped_threads(self.debugger)
        shown = self.focus.now.shown
        return (
            shown is not None
            and isinstance(thread, int)
            and thread < RANK_IDS
            and thread not in kernel_stopped
            and self.ids["threads"].inward(shown) is not None
        )

    def _owner(self, arguments: Message) -> RankEngine | None:
        for key, kind in ID_KEYS.items():
            number = arguments.get(key)
            if isinstance(number, int) and number >= RANK_IDS:
                found = self.ids[kind].inward(number)
                return None if found is None else found[0]
        return None

    def _for_rank(self, rank: RankEngine, message: Message) -> Message:
        """A request about a rank's thread, frame or variable, answered by that rank."""
        command, arguments = message["command"], self._inward(message.get("arguments") or {})
        if command == "richInspectVariables":
            return self._rich(rank, message, arguments)
        if command == "copyToGlobals":
            command, arguments = (
                "setExpression",
                {
                    "expression": f"globals()[{arguments['dstVariableName']!r}]",
                    "value": arguments["srcVariableName"],
                    "frameId": arguments["srcFrameId"],
                },
            )
        try:
            reply = self._outward(rank, rank.request(command, arguments))
        except ConnectionError as e:
            reply = _left(rank, command, e)
        except TimeoutError as e:
            reply = {"success": False, "message": f"{rank.label}: {e}"}
        if command == "stackTrace" and reply.get("success"):
            self._rank_frames(rank, reply["body"], arguments.get("startFrame", 0))
        if command == "variables" and reply.get("success"):
            accept = ipykernel_private.variable_filter(self.debugger)
            reply["body"]["variables"] = [v for v in reply["body"]["variables"] if accept(v["name"])]
        return {
            **reply,
            "type": "response",
            "command": message["command"],
            "request_seq": message["seq"],
            "seq": message["seq"],
        }

    def _rank_frames(self, rank: RankEngine, body: Message, start: int) -> None:
        """A rank's stack as its cell sees it: down to the cell's own frame, each frame named with the rank
        (JupyterLab shows frames, not threads). The frames below are how the rank came to run the cell:
        the kernel's, copied by the fork, or the fork server's."""
        frames = body.get("stackFrames", [])
        for index, frame in enumerate(frames):
            frame["name"] = f"{rank.label}: {frame['name']}"
            if frame.get("source", {}).get("path") == self.cell_file and frame["name"].endswith("<module>"):
                del frames[index + 1 :]
                body["totalFrames"] = start + index + 1
                return

    def _rich(self, rank: RankEngine, message: Message, arguments: Message) -> Message:
        """A variable's rich display, formatted in the rank as the notebook would format it."""
        name = arguments.get("variableName", "")
        data: Message = {"data": {}, "metadata": {}}
        if name.isidentifier():
            try:
                reply = rank.request(
                    "evaluate",
                    {
                        "expression": _RICH.format(name=name),
                        "frameId": arguments.get("frameId"),
                        "context": "clipboard",
                    },
                )
                if reply.get("success"):
                    bundle, metadata = ast.literal_eval(reply["body"]["result"])
                    data = {"data": bundle, "metadata": {kind: metadata[kind] for kind in metadata if kind in bundle}}
            except (ConnectionError, TimeoutError, ValueError, SyntaxError):
                pass
        return {
            "type": "response",
            "request_seq": message["seq"],
            "seq": message["seq"],
            "success": True,
            "command": message["command"],
            "body": data,
        }

    def _threads(self) -> list[Message]:
        """Every connected rank's threads, named after the rank."""
        threads = []
        for rank in self._connected():
            try:
                reply = rank.request("threads", {}, timeout=2.0)
            except (ConnectionError, TimeoutError):
                continue
            for thread in reply.get("body", {}).get("threads", []):
                if thread["name"].startswith(_OWN_THREADS):
                    continue
                name = rank.label if thread["name"] == "MainThread" else f"{rank.label}: {thread['name']}"
                threads.append({"id": self.ids["threads"].outward(rank, thread["id"]), "name": name})
        return threads

    def _stopped_threads(self) -> list[int]:
        return self.focus.now.stopped_threads()

    def _connected(self) -> list[RankEngine]:
        with self.lock:
            return list(self.ranks)

    # -- ids ---------------------------------------------------------------------------------------
    def _inward(self, value: Any) -> Any:
        return translate(value, lambda kind, number: self._local(kind, number))

    def _local(self, kind: str, number: int) -> int:
        found = self.ids[kind].inward(number) if number >= RANK_IDS else None
        return number if found is None else found[1]

    def _outward(self, rank: RankEngine, value: Any) -> Any:
        return translate(value, lambda kind, number: self.ids[kind].outward(rank, number))

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


def _left(rank: RankEngine, command: str, error: ConnectionError) -> Message:
    """The answer for a rank that left the debugger before it answered. A rank leaves only by ending: one
    told to go on did, whether or not its answer went out before it ended (its threads' exit follows,
    ``_gone``); any other request failed."""
    if command in GOING_ON:
        return {"success": True, "body": {}}
    return {"success": False, "message": f"{rank.label}: {error}"}
