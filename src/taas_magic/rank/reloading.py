"""Autoreload in a session's ranks: they reload the modules the kernel's ``%autoreload`` would.

IPython's autoreload extension reloads changed modules in the kernel before each cell. A
session's ranks imported their modules once and have no extension of their own, so the kernel
reads its autoreload's state with each session cell (``KernelReloads.for_cell``) and sends it as
a ``Reload`` (``wire/rank_control.py``). The rank (``RankReloads``) then reloads its own changed modules with IPython's
``ModuleReloader``, whose superreload gives functions and classes the rank already holds the new
code, as in the kernel. With autoreload off the ranks keep what they imported, as the kernel does.

The rank reloads a changed module whole (``superreload``, as ``%autoreload 2 --full``): IPython's
default reloader that patches only the changed functions needs the source as the module was
imported, read before the file changed, which a rank started by the fork server never saw.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from taas_magic.wire.rank_control import Reload


class RankReloads:
    """The rank's modules, with the time of each one's file when the rank loaded it.

    Those times are what a file's change is measured against, as in the kernel's reloader: taken
    when the rank starts (a forked rank holds the kernel's modules as they are then) and after each
    cell for the modules it imported. IPython's reloader is made when a cell first asks for it.
    """

    def __init__(self, namespace: dict[str, Any]):
        self.namespace = namespace
        self.loaded: set[str] = set()
        self.times: dict[str, float] = {}
        self.reloader: Any = None
        self.after_cell()

    def after_cell(self) -> None:
        """Note the modules imported since the last call (the kernel's reloader does it after each cell)."""
        new = set(sys.modules) - self.loaded
        for name in new:
            when = _file_time(sys.modules.get(name))
            if when is not None:
                self.times.setdefault(name, when)
        self.loaded |= new

    def before_cell(self, reload: Reload | None) -> None:
        """Reload what ``reload`` says changed; a module that fails to reload says so on stderr and
        stays as it was, as in the kernel."""
        if reload is None:
            return
        reloader = self._reloader()
        reloader.enabled = True
        reloader.check_all = reload.every
        reloader.autoload_obj = reload.new_objects
        reloader.modules = dict.fromkeys(reload.modules, True)
        reloader.skip_modules = dict.fromkeys(reload.skip, True)
        reloader.check()

    def _reloader(self) -> Any:
        if self.reloader is None:
            from IPython.extensions.autoreload import ModuleReloader

            # %autoreload 3 binds a module's new names in the namespace of the reloader's shell.
            self.reloader = ModuleReloader(types.SimpleNamespace(user_ns=self.namespace))
            self.reloader.deduper_reloader.enabled = False  # see the module's docstring
            self.reloader.modules_mtimes = self.times  # as loaded, not as now: the files may have changed since
        return self.reloader


def _file_time(module: Any) -> float | None:
    """When the source file of ``module`` last changed; None for a module without one."""
    filename = getattr(module, "__file__", None)
    if not isinstance(filename, str) or not filename.endswith(".py"):
        return None
    try:
        return os.stat(filename).st_mtime
    except OSError:
        return None
