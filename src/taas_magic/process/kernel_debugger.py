"""Keeping the kernel's own debugger out of what taas starts.

When the notebook's visual debugger is on (JupyterLab's bug icon, VS Code's "Debug Cell"), the
kernel runs debugpy, which patches ``os.fork`` and the functions that start programs: a process
forked or started from the kernel then connects to the kernel's debug adapter and waits for a
client to attach to it, which no front end does. A taas cell would hang there, and once the
debugger is off again, each start would wait for an adapter that is gone.

taas starts its processes around those patches (``fork``, ``plain_subprocesses``), and a process
forked from the kernel drops what it inherited of the debugger before anything else (``forget``):
the trace function of the thread that forked it, the patched functions (a rank's DataLoader forks
its workers), the debugger object. Nothing is sent to the adapter: the kernel's session goes on as
it was. Without debugpy loaded, each of these is the plain call. The debugpy internals named here are checked
against each debugpy release with ``pydevd_private.py``'s (``KERNEL_DEBUGGER``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

_MONKEY = "_pydev_bundle.pydev_monkey"  # debugpy's (pydevd's) patches of process creation
_PATCHED_MODULES = ("os", "_posixsubprocess", "subprocess")  # where it keeps the originals as original_NAME


def fork() -> int:
    """``os.fork`` as Python has it: the child does not join the kernel's debugging session."""
    fork_as_python_has_it: Any = getattr(os, "original_fork", os.fork)
    return int(fork_as_python_has_it())


@contextlib.contextmanager
def plain_subprocesses() -> Iterator[None]:
    """Programs started meanwhile (in this thread) are started as asked, not under the kernel's debugger."""
    monkey = sys.modules.get(_MONKEY)
    skip: Any = getattr(monkey, "skip_subprocess_arg_patch", None)
    with skip() if skip is not None else contextlib.nullcontext():
        yield


def hidden_thread(work: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """A thread of taas's own, started: a debugger (the kernel's, or a rank's in the notebook's visual
    debugger) neither traces it, nor lists it, nor stops it when it pauses the process (pydevd leaves alone
    the threads marked as its own). In a rank, a pause then stops the user's threads only, and says so
    for one of them: never for taas's samplers, which go on sending."""
    thread = threading.Thread(target=work, args=args, name=name, daemon=True)
    setattr(thread, "is_pydev_daemon_thread", True)
    setattr(thread, "pydev_do_not_trace", True)
    thread.start()
    return thread


def untraced(work: Callable[[], T]) -> T:
    """``work()``, outside the kernel's debugger when it is on: under its trace function importing torch
    takes minutes instead of seconds. The caller waits for it as for a call."""
    if sys.gettrace() is None and _MONKEY not in sys.modules:
        return work()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as e:  # handed to the caller as its own
            outcome.append((False, e))

    hidden_thread(run, name="taas-untraced").join()
    done, value = outcome[0]
    if not done:
        raise value
    return value  # type: ignore[no-any-return]


def forget() -> None:
    """In a process just forked from the kernel: nothing of the kernel's debugger stays active here."""
    if _MONKEY not in sys.modules:
        return
    tracing: Any = sys.modules.get("pydevd_tracing")
    if tracing is not None:
        tracing.restore_sys_set_trace_func()  # its own sys.settrace, which warns and re-traces
    sys.settrace(None)
    threading.settrace(None)  # type: ignore[arg-type,unused-ignore]  # None: no trace for threads started from now on
    _stop_monitoring()
    sys.modules[_MONKEY].undo_patch_thread_modules()
    for name in _PATCHED_MODULES:
        _restore_originals(sys.modules.get(name))
    constants: Any = sys.modules.get("_pydevd_bundle.pydevd_constants")
    if constants is not None:
        constants.set_global_debugger(None)


def _restore_originals(module: Any) -> None:
    """The functions the debugger replaced in ``module``, as they were (it keeps them as original_NAME)."""
    if module is None:
        return
    for attribute in [name for name in vars(module) if name.startswith("original_")]:
        setattr(module, attribute[len("original_") :], getattr(module, attribute))
        delattr(module, attribute)


def _stop_monitoring() -> None:
    """Python 3.12 and later: the debugger traces through ``sys.monitoring``, which a fork keeps."""
    monitoring: Any = getattr(sys, "monitoring", None)
    if monitoring is None or monitoring.get_tool(monitoring.DEBUGGER_ID) is None:
        return
    monitoring.set_events(monitoring.DEBUGGER_ID, 0)
    for event in vars(monitoring.events).values():
        if isinstance(event, int) and event and not event & (event - 1):  # each single event
            monitoring.register_callback(monitoring.DEBUGGER_ID, event, None)
    monitoring.free_tool_id(monitoring.DEBUGGER_ID)
