"""pydevd's internals (the debugger engine debugpy carries) that taas uses, each behind one function here, where
its public ``settrace``/``stoptrace`` do not do the job. ``process/kernel_debugger.py`` keeps the kernel's own
debugger out of what taas starts with some more of them, named in ``KERNEL_DEBUGGER``.

A debugpy release that moves or drops one fails ``tests/unit/process/test_debugger_private.py``, which names
debugpy's version and what is missing:

- ``debugpy._vendored.force_pydevd``: puts debugpy's own pydevd first on the path; ``pydevd.SetupHolder.setup``
  holds the settings of the last ``settrace``, which a rank forked from a kernel with its debugger on inherits
  (``engine`` clears them). Without them: ranks do not join the notebook's debugger.
- ``PyDB.is_attached()`` (set by ``configurationDone``) and ``PyDB.pydb_disposed``: whether the kernel gave a
  new engine the notebook's breakpoints, or its connection ended. Without them: joining waits its whole time.
- ``PyDB.reader`` and ``PyDB.writer``: the connection's threads, waited for as an engine ends (its queued
  answers go out first). Without them: an ended engine is not waited for.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from typing import Any

KERNEL_DEBUGGER = (  # (module, attribute) that process/kernel_debugger.py uses, where debugpy is loaded
    ("_pydev_bundle.pydev_monkey", "skip_subprocess_arg_patch"),
    ("_pydev_bundle.pydev_monkey", "undo_patch_thread_modules"),
    ("pydevd_tracing", "restore_sys_set_trace_func"),
    ("_pydevd_bundle.pydevd_constants", "set_global_debugger"),
)


def engine() -> Any:
    """pydevd as debugpy carries it, without the settings of an engine a fork inherited."""
    importlib.import_module("debugpy._vendored.force_pydevd")  # first: it puts debugpy's pydevd on the path
    import pydevd  # type: ignore[import-not-found]

    pydevd.SetupHolder.setup = None
    return pydevd


def forget_settings(pydevd: Any) -> None:
    """After ``stoptrace``: the next ``settrace`` starts from its own arguments alone."""
    pydevd.SetupHolder.setup = None


def given_breakpoints(running: Any) -> bool:
    """Whether the kernel sent the running engine (``pydevd.get_global_debugger()``) ``configurationDone``."""
    return bool(running.is_attached())


def connection_ended(running: Any) -> bool:
    return bool(getattr(running, "pydb_disposed", False))


def connection_threads(running: Any) -> list[threading.Thread]:
    """The threads that read and write the engine's connection, where it had one."""
    found = (getattr(running, "reader", None), getattr(running, "writer", None))
    return [thread for thread in found if isinstance(thread, threading.Thread) and thread.ident is not None]


def missing() -> list[str]:
    """What of this module, and of ``KERNEL_DEBUGGER``, the installed debugpy lacks (imports pydevd)."""
    if importlib.util.find_spec("debugpy") is None:
        return ["debugpy"]
    try:
        pydevd = engine()
    except ImportError as e:
        return [f"debugpy._vendored.force_pydevd ({e})"]
    absent = [] if hasattr(getattr(pydevd, "SetupHolder", None), "setup") else ["pydevd.SetupHolder.setup"]
    debugger_class = getattr(pydevd, "PyDB", None)
    for name in ("is_attached", "pydb_disposed", "reader", "writer"):
        if not _has(debugger_class, name):
            absent.append(f"pydevd.PyDB.{name}")
    for module, name in KERNEL_DEBUGGER:
        try:
            found = importlib.import_module(module)
        except ImportError:
            found = None
        if not hasattr(found, name):
            absent.append(f"{module}.{name}")
    return absent


def _has(cls: Any, name: str) -> bool:
    """A method or class attribute, or an attribute its ``__init__`` sets (instances cost a running engine)."""
    if cls is None:
        return False
    if hasattr(cls, name):
        return True
    import inspect

    try:
        return f"self.{name} =" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False
