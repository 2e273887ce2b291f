"""A rank as threads of the notebook's visual debugger (JupyterLab's, VS Code's).

While a debugging client is attached to the kernel, a cell's ``DebugLink`` says where the kernel
listens for its ranks. A rank joins by starting the debugger's engine (pydevd, which debugpy
carries) connected to that address: the kernel sends it the notebook's breakpoints and shows its
threads, stops and values in its own session (``kernel/debugging/visual_debugger.py``). A rank joins as
its cell starts when breakpoints are set, or at its first ``breakpoint()``; it stays joined for
the rest of its life (a session's later cells too). A rank not to be debugged never imports the
engine.
"""

from __future__ import annotations

import enum
import os
import socket
import sys
import time
from typing import Any, Callable

from taas_magic.process import pydevd_private
from taas_magic.wire.task import DebugLink

JOIN_SECONDS = 30.0  # the kernel answers a rank in well under a second; this much is a kernel that is gone
JOIN_ATTEMPTS = 3
STOP_SECONDS = 5.0  # for an ended engine's threads to go
LEAVE_SECONDS = 1.0  # for them to go as the rank ends: what the engine has queued is sent in milliseconds
_joined: int | None = None  # the kernel's port this rank joined on (a session's rank stays joined)
_pdb_hook: Callable[..., Any] | None = None  # breakpoint()'s hook before a link took it over


def take_part(link: DebugLink | None, rank: int) -> None:
    """At a cell's start: join the kernel's debugging session if ``link`` asks for it now; a
    ``breakpoint()`` in the cell stops in the visual debugger while one is attached, else in pdb."""
    global _pdb_hook
    if _pdb_hook is None:
        _pdb_hook = sys.breakpointhook
    if link is None or not link.takes_part(rank):
        sys.breakpointhook = _pdb_hook
        return
    sys.breakpointhook = lambda *args, **kwargs: _visual_breakpoint(link, rank, args, kwargs)
    if link.eager:
        _join(link, rank)


def leave() -> None:
    """At the rank's end: end its engine, which first sends what it has queued (a rank ended by a ``continue``
    would otherwise exit before the answer to it left, and the front end read that it failed)."""
    if _joined is not None:
        _stop(_engine(), LEAVE_SECONDS)


def _visual_breakpoint(link: DebugLink, rank: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``breakpoint()``: stop at the caller's line as a thread of the notebook's debugger."""
    if not _join(link, rank):
        return _pdb_hook(*args, **kwargs) if _pdb_hook is not None else None
    import pydevd  # type: ignore[import-not-found]  # debugpy's engine, on the path once joined

    pydevd.settrace(
        suspend=True, trace_only_current_thread=True, patch_multiprocessing=False, stop_at_frame=sys._getframe(2)
    )  # the caller of breakpoint(), past this hook's lambda
    return None


def _join(link: DebugLink, rank: int) -> bool:
    """Connect this rank's debugger engine to the kernel; False when the kernel no longer listens
    (the client detached since the cell was sent) or does not answer.

    An engine whose connection ended before the kernel gave it the breakpoints is started again (twice at
    most) while the kernel listens: on a busy machine the engine of the session the client left can still
    be ending, and the new one's first connection may not survive it."""
    global _joined
    if _joined == link.port:
        return True
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # the rank's own environment: no warning on stderr
    for _ in range(JOIN_ATTEMPTS):
        if not _listening(link.port):
            return False
        pydevd = _engine()
        if _joined is not None:
            _stop(pydevd)  # the debugger was switched off and on again since: join its new session
        _connect(pydevd, link, rank)
        state = _ready(pydevd.get_global_debugger())
        if state is _Join.READY:
            _joined = link.port
            return True
        _stop(pydevd)  # the kernel refused the rank or went away before giving it the breakpoints
        _joined = None
        if state is _Join.LATE:
            return False
    return False


def _connect(pydevd: Any, link: DebugLink, rank: int) -> None:
    pydevd.settrace(
        "127.0.0.1",
        port=link.port,
        suspend=False,
        trace_only_current_thread=False,
        patch_multiprocessing=False,
        wait_for_ready_to_run=False,  # waited for below: pydevd's own wait never ends if the kernel hangs up
        notify_stdin=False,
        access_token=link.secret,
        client_access_token=link.token(rank),
        protocol="dap",
    )


def _stop(pydevd: Any, seconds: float = STOP_SECONDS) -> None:
    """End the engine, and wait (``seconds`` at most) for the threads of its connection, which pydevd
    gives half a second: a new engine's connection must not meet the old one's end. Its writer sends what
    was queued before it ends."""
    engine = pydevd.get_global_debugger()
    pydevd.stoptrace()
    pydevd_private.forget_settings(pydevd)
    deadline = time.monotonic() + seconds
    for thread in [] if engine is None else pydevd_private.connection_threads(engine):
        thread.join(max(0.0, deadline - time.monotonic()))


class _Join(enum.Enum):
    """How an engine's connection to the kernel turned out."""

    READY = "the kernel gave it the notebook's breakpoints (configurationDone)"
    ENDED = "its connection ended first: worth another try while the kernel listens"
    LATE = f"nothing came within JOIN_SECONDS ({JOIN_SECONDS:g} s)"


def _ready(engine: Any) -> _Join:
    """Wait until the kernel gave the engine the notebook's breakpoints, or the connection ended, or it is late."""
    deadline = time.monotonic() + JOIN_SECONDS
    while engine is not None and not pydevd_private.given_breakpoints(engine):
        if pydevd_private.connection_ended(engine):
            return _Join.ENDED
        if time.monotonic() > deadline:
            return _Join.LATE
        time.sleep(0.01)
    return _Join.READY if engine is not None else _Join.ENDED


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _engine() -> Any:
    """pydevd as debugpy carries it, set up afresh: a rank forked from a kernel whose debugger was on
    has the kernel's pydevd loaded, with the kernel's settings (``process/kernel_debugger.forget``
    dropped its connection)."""
    return pydevd_private.engine()


def rich(value: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``value``'s display as the notebook shows it (its MIME bundle and metadata), for the debugger's
    variables panel; the kernel evaluates this in the rank's frame."""
    from IPython.core.formatters import DisplayFormatter

    data, metadata = DisplayFormatter().format(value)
    return {kind: shown for kind, shown in data.items() if isinstance(shown, str)}, metadata
