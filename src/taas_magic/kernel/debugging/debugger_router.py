"""Which rank a front end's debug request is for, and each message between them as the other end must read it.

The front end sees one debugging session; each rank's engine numbers its threads, frames and variables from 1,
as the kernel's own debugger does. So every id a rank sends is given a number of the kernel's here, from
``RANK_IDS`` on (a range the kernel's small counters never reach), and a request that names such a number goes
to that rank with the rank's own id. Replies come back with the rank's ids swapped for the front end's, its
stack cut at the cell's frame and its threads named after the rank (``rank N``, ``rank N: name``).

Pure decisions, no sockets and no threads: ``kernel/debugging/visual_debugger.py`` does the I/O. A rank is any hashable
object with a ``label`` (a connected ``RankEngine`` in the kernel).
"""

from __future__ import annotations

import ast
import itertools
import threading
from typing import Any, Callable, Generic, Protocol, TypeVar

Message = dict[str, Any]

RANK_IDS = 1 << 28  # ids given to ranks' threads, frames and variables start here: the kernel's are small counters
KINDS = ("threads", "frames", "variables")
ID_KEYS = {"threadId": "threads", "frameId": "frames", "srcFrameId": "frames", "variablesReference": "variables"}
GOING_ON = ("continue", "next", "stepIn", "stepOut")  # requests that let a stopped thread run
_LISTS_OF_IDS = {"threads": "threads", "stackFrames": "frames"}  # lists whose items' "id" is of that kind
_OWN_THREADS = "taas-"  # taas's threads in a rank (its lifeline, its samplers): not the user's to debug
_RICH = "__import__('taas_magic.rank.visual_debugging', fromlist=['rich']).rich({name})"


class Rank(Protocol):
    """What the router needs of a rank: the name the front end shows it by."""

    @property
    def label(self) -> str: ...


R = TypeVar("R", bound=Rank)


class Ids(Generic[R]):
    """Ids of one kind as the front end sees them, each standing for one rank's own. Thread-safe: the focus
    thread and the kernel's control loop number ids at once."""

    def __init__(self) -> None:
        self.numbers = itertools.count(RANK_IDS)
        self.theirs: dict[int, tuple[R, int]] = {}
        self.ours: dict[tuple[R, int], int] = {}
        self.lock = threading.Lock()

    def outward(self, rank: R, number: int) -> int:
        if number <= 0:
            return number  # 0: no variables to expand
        with self.lock:
            key = (rank, number)
            if key not in self.ours:
                self.ours[key] = next(self.numbers)
                self.theirs[self.ours[key]] = key
            return self.ours[key]

    def inward(self, number: int) -> tuple[R, int] | None:
        with self.lock:
            return self.theirs.get(number)

    def of(self, rank: R) -> list[int]:
        with self.lock:
            return [ours for ours, (owner, _) in self.theirs.items() if owner == rank]

    def forget(self, rank: R) -> None:
        with self.lock:
            for ours in [ours for ours, (owner, _) in self.theirs.items() if owner == rank]:
                self.ours.pop(self.theirs.pop(ours), None)


def translate(value: Any, swap: Callable[[str, int], int], kind_of_id: str | None = None) -> Any:
    """``value`` with each thread, frame and variable id in it swapped (``swap(kind, id)``); a copy, whatever
    else it holds unchanged."""
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


def unanswered(rank: Rank, command: str, error: ConnectionError | TimeoutError) -> Message:
    """The rank's reply to ``command`` when it gave none. A rank leaves only by ending (``ConnectionError``): one
    told to go on did, whether or not its answer went out before it ended; any other request failed."""
    if isinstance(error, ConnectionError) and command in GOING_ON:
        return {"success": True, "body": {}}
    return {"success": False, "message": f"{rank.label}: {error}"}


class Router(Generic[R]):
    """The id tables of one debugging session (``ids``, by kind, shared with the focus) and what follows from them."""

    def __init__(self) -> None:
        self.ids: dict[str, Ids[R]] = {kind: Ids() for kind in KINDS}

    def owner(self, arguments: Message) -> R | None:
        """The rank whose thread, frame or variable a request's arguments name; None: the kernel's own."""
        for key, kind in ID_KEYS.items():
            number = arguments.get(key)
            if isinstance(number, int) and number >= RANK_IDS:
                found = self.ids[kind].inward(number)
                return None if found is None else found[0]
        return None

    def request(self, message: Message) -> tuple[str, Message]:
        """The command and arguments the owning rank is sent for the front end's request: its own ids, and
        ``copyToGlobals`` (the kernel's, which pydevd lacks) as the assignment it stands for."""
        command, arguments = message["command"], self.inward(message.get("arguments") or {})
        if command == "copyToGlobals":
            return "setExpression", {
                "expression": f"globals()[{arguments['dstVariableName']!r}]",
                "value": arguments["srcVariableName"],
                "frameId": arguments["srcFrameId"],
            }
        return command, arguments

    def reply(
        self, rank: R, answer: Message, message: Message, cell_file: str, accept: Callable[[str], bool]
    ) -> Message:
        """The rank's ``answer`` to the front end's request ``message`` as the front end reads it: the front end's
        ids, the stack down to the frame of the cell compiled as ``cell_file``, the variables ``accept`` lets
        through, and the response envelope of ``message``."""
        reply: Message = self.outward(rank, answer)
        command = message["command"]
        if command == "stackTrace" and reply.get("success"):
            start = (message.get("arguments") or {}).get("startFrame", 0)
            _cut_at_the_cell(rank, reply["body"], start, cell_file)
        if command == "variables" and reply.get("success"):
            reply["body"]["variables"] = [v for v in reply["body"]["variables"] if accept(v["name"])]
        return _response(message, reply)

    def threads(self, rank: R, answer: Message) -> list[Message]:
        """The front end's entries for a rank's reply to ``threads``: named after the rank, taas's own left out."""
        entries = []
        for thread in answer.get("body", {}).get("threads", []):
            if thread["name"].startswith(_OWN_THREADS):
                continue
            name = rank.label if thread["name"] == "MainThread" else f"{rank.label}: {thread['name']}"
            entries.append({"id": self.ids["threads"].outward(rank, thread["id"]), "name": name})
        return entries

    def continues_the_shown_rank(self, arguments: Message, kernel_stopped: set[int], shown: int | None) -> bool:
        """Whether a ``continue`` meant for none of the kernel's stopped threads (``kernel_stopped``) is for the
        rank thread the front end shows (``shown``): JupyterLab forgets the thread it shows before it sends
        ``continue``, and names thread 1."""
        thread = arguments.get("threadId")
        return (
            shown is not None
            and isinstance(thread, int)
            and thread < RANK_IDS
            and thread not in kernel_stopped
            and self.ids["threads"].inward(shown) is not None
        )

    def rich_request(self, message: Message) -> Message | None:
        """The ``evaluate`` arguments that format a ``richInspectVariables`` request's variable in its rank as the
        notebook would format it; None for a name that is not a variable's (the rank is not asked)."""
        arguments = self.inward(message.get("arguments") or {})
        name = arguments.get("variableName", "")
        if not name.isidentifier():
            return None
        return {"expression": _RICH.format(name=name), "frameId": arguments.get("frameId"), "context": "clipboard"}

    def rich_reply(self, message: Message, answer: Message | None) -> Message:
        """The front end's reply to ``richInspectVariables`` from the rank's answer to the ``rich_request``
        (None: it gave none). Always a success: an empty display where the rank could not format the value."""
        data: Message = {"data": {}, "metadata": {}}
        if answer is not None and answer.get("success"):
            try:
                bundle, metadata = ast.literal_eval(answer["body"]["result"])
                data = {"data": bundle, "metadata": {kind: metadata[kind] for kind in metadata if kind in bundle}}
            except (ValueError, SyntaxError):
                pass
        return _response(message, {"success": True, "body": data})

    def inward(self, value: Any) -> Any:
        """``value`` with the front end's numbers for ranks' ids swapped back for the ranks' own."""
        return translate(value, self._local)

    def outward(self, rank: R, value: Any) -> Any:
        """``value``, from ``rank``, with its ids swapped for the front end's numbers."""
        return translate(value, lambda kind, number: self.ids[kind].outward(rank, number))

    def _local(self, kind: str, number: int) -> int:
        found = self.ids[kind].inward(number) if number >= RANK_IDS else None
        return number if found is None else found[1]


def _cut_at_the_cell(rank: Rank, body: Message, start: int, cell_file: str) -> None:
    """A rank's stack as its cell sees it: down to the cell's own frame, each frame named with the rank
    (JupyterLab shows frames, not threads). The frames below are how the rank came to run the cell:
    the kernel's, copied by the fork, or the fork server's."""
    frames = body.get("stackFrames", [])
    for index, frame in enumerate(frames):
        frame["name"] = f"{rank.label}: {frame['name']}"
        if frame.get("source", {}).get("path") == cell_file and frame["name"].endswith("<module>"):
            del frames[index + 1 :]
            body["totalFrames"] = start + index + 1
            return


def _response(message: Message, reply: Message) -> Message:
    """``reply`` in the envelope of a response to the front end's request ``message``."""
    return {
        **reply,
        "type": "response",
        "command": message["command"],
        "request_seq": message["seq"],
        "seq": message["seq"],
    }
