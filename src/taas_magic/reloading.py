"""Autoreload in a session's ranks: they reload the modules the kernel's ``%autoreload`` would.

IPython's autoreload extension reloads changed modules in the kernel before each cell. A
session's ranks imported their modules once and have no extension of their own, so the kernel
reads its autoreload's state with each session cell (``KernelReloads.for_cell``) and sends it as
a ``Reload``. The rank (``RankReloads``) then reloads its own changed modules with IPython's
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
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reload:
    """Which changed modules a rank reloads before a cell, as the kernel's autoreload did before it."""

    every: bool  # every changed module (%autoreload 2 or 3); else those in ``modules``
    modules: tuple[str, ...] = ()  # %aimport-ed, or reloaded in the kernel since the last cell (%autoreload now)
    skip: tuple[str, ...] = ()  # %aimport -NAME: never reloaded
    new_objects: bool = False  # %autoreload 3: names new in a module join the namespace too


# -- in the kernel ----------------------------------------------------------------------------
def kernel_reloader(shell: Any) -> Any | None:
    """The ``ModuleReloader`` of the kernel's autoreload extension, once ``%load_ext autoreload`` loaded it."""
    registry = getattr(getattr(shell, "magics_manager", None), "registry", {})
    return getattr(registry.get("AutoreloadMagics"), "_reloader", None)


def mode(shell: Any) -> str:
    """The kernel's autoreload as the user set it: ``%autoreload 2 is on``, or ``autoreload is off``."""
    reloader = kernel_reloader(shell)
    if reloader is None or not reloader.enabled:
        return "autoreload is off"
    level = 3 if reloader.autoload_obj else 2 if reloader.check_all else 1
    return f"%autoreload {level} is on" + ("" if reloader.check_all else ": the modules named with %aimport")


def describe(shell: Any) -> str:
    """What becomes of a session's modules when their files change, for ``%taas``."""
    state = mode(shell)
    if state == "autoreload is off":
        return f"kept as the session's ranks imported them ({state})"
    return f"reloaded in the session's ranks before each cell when changed ({state})"


class KernelReloads:
    """What the kernel's autoreload reloaded since each rank's last session cell, and how it stands now.

    The kernel's reloader notes the time of each module's file when it loads it; a time that moved
    between two session cells is a module the kernel reloaded, whether before a cell (``%autoreload
    2``) or once (``%autoreload now``). Each rank reloads those with its next cell, even when the
    cells between ran in other ranks (``--ranks``).
    """

    def __init__(self, shell: Any):
        self.reloader, self.marks = self._times(shell)
        self.cells = 0  # session cells sent, the first (which started the session) not counted
        self.reloaded: dict[str, int] = {}  # module -> the cell before which the kernel last reloaded it
        self.told: dict[int, int] = {}  # rank -> the last cell it was sent (0: none since the session started)

    @staticmethod
    def _times(shell: Any) -> tuple[Any, dict[str, float]]:
        reloader = kernel_reloader(shell)
        return reloader, (dict(reloader.modules_mtimes) if reloader is not None else {})

    def for_cell(self, shell: Any, ranks: list[int]) -> Reload | None:
        """What ``ranks`` reload before this cell; None: nothing, they keep what they imported."""
        last_reloader, last = self.reloader, self.marks
        self.reloader, self.marks = self._times(shell)
        reloader = self.reloader
        # A new reloader (%reload_ext autoreload) notes the files' times as they are now: a
        # difference from the last one's is no reload.
        same = reloader is not None and reloader is last_reloader
        self.cells += 1
        self.reloaded.update({name: self.cells for name, when in self.marks.items()
                              if same and last.get(name, when) != when})
        since = min((self.told.get(rank, 0) for rank in ranks), default=self.cells)
        moved = {name for name, cell in self.reloaded.items() if cell > since}
        self.told.update(dict.fromkeys(ranks, self.cells))
        if reloader is None or not reloader.enabled:
            return Reload(False, tuple(sorted(moved))) if moved else None
        return Reload(bool(reloader.check_all), tuple(sorted(set(reloader.modules) | moved)),
                      tuple(sorted(reloader.skip_modules)), bool(reloader.autoload_obj))


# -- in a session's rank ----------------------------------------------------------------------
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
