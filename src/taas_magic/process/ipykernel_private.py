"""ipykernel's ``Debugger`` internals that the visual debugger of ranks uses, each behind one function here:
ipykernel documents the debug messages, not the object that answers them.

A release that renames or drops one fails ``tests/unit/process/test_ipykernel_private.py``, which names
ipykernel's version and the attribute; each caller has a way on without it, so the kernel's own debugger and
every cell keep working:

- ``kernel.debugger.process_request``: the coroutine that answers the front end's debug requests; taas stands
  in front of it (``intercept``). Without it: ranks do not join the notebook's debugger.
- ``event_callback(message)``: sends a ``debug_event`` to the front end. Without it: the same.
- ``is_started``: whether a debugging client is attached. Without it: not attached.
- ``stopped_threads``: the kernel's own stopped threads. Without it: none.
- ``accept_variable(name)``: the variables the kernel's debugger hides. Without it: none hidden.
- ``just_my_code``: the client's choice of stepping into libraries. Without it: only the user's code.
- ``breakpoint_list``: ``{path: breakpoints}`` the kernel keeps across detaching. Without it: the breakpoints
  set since the extension loaded.
"""

from __future__ import annotations

from typing import Any, Callable

ATTRIBUTES = (
    "process_request",
    "event_callback",
    "is_started",
    "stopped_threads",
    "accept_variable",
    "just_my_code",
    "breakpoint_list",
)


def debugger_of(shell: Any) -> Any | None:
    """The notebook kernel's debugger, where it has one taas can stand in front of (None in a terminal)."""
    debugger = getattr(getattr(shell, "kernel", None), "debugger", None)
    return debugger if debugger is not None and hasattr(debugger, "process_request") else None


def intercept(debugger: Any, handler: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """Make ``handler`` answer the debugger's requests; returns the debugger's own answerer, for ``handler`` to
    pass on what is not about ranks."""
    original: Callable[[dict[str, Any]], Any] = debugger.process_request
    debugger.process_request = handler
    return original


def release(debugger: Any, handler: Callable[[dict[str, Any]], Any], original: Callable[[dict[str, Any]], Any]) -> None:
    """Give the debugger its own answerer back, unless someone stood in front of ``handler`` since."""
    if debugger.__dict__.get("process_request") == handler:
        debugger.process_request = original


def send_event(debugger: Any, event: dict[str, Any]) -> None:
    debugger.event_callback(event)


def attached(debugger: Any) -> bool:
    return bool(getattr(debugger, "is_started", False))


def stopped_threads(debugger: Any) -> set[int]:
    return set(getattr(debugger, "stopped_threads", set()))


def variable_filter(debugger: Any) -> Callable[[str], bool]:
    accept: Callable[[str], bool] = getattr(debugger, "accept_variable", lambda name: True)
    return accept


def just_my_code(debugger: Any) -> bool:
    return bool(getattr(debugger, "just_my_code", True))


def kept_breakpoints(debugger: Any) -> dict[str, list[dict[str, Any]]]:
    return dict(getattr(debugger, "breakpoint_list", {}) or {})


def missing(debugger: Any) -> list[str]:
    """The attributes of this module that ``debugger`` (an ipykernel ``Debugger``) lacks."""
    return [f"Debugger.{name}" for name in ATTRIBUTES if not hasattr(debugger, name)]
