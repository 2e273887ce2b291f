"""Autoreload for a session's ranks, in the kernel: what the kernel's ``%autoreload`` reloaded since each
rank's last cell, sent with the next one as a ``Reload`` (``wire/rank_control.py``; ``rank/reloading.py``
reloads it there).
"""

from __future__ import annotations

from typing import Any

from taas_magic.wire.rank_control import Reload


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
        self.reloaded.update(
            {name: self.cells for name, when in self.marks.items() if same and last.get(name, when) != when}
        )
        since = min((self.told.get(rank, 0) for rank in ranks), default=self.cells)
        moved = {name for name, cell in self.reloaded.items() if cell > since}
        self.told.update(dict.fromkeys(ranks, self.cells))
        if reloader is None or not reloader.enabled:
            return Reload(False, tuple(sorted(moved))) if moved else None
        return Reload(
            bool(reloader.check_all),
            tuple(sorted(set(reloader.modules) | moved)),
            tuple(sorted(reloader.skip_modules)),
            bool(reloader.autoload_obj),
        )
