"""The files IPython compiled the notebook's cells as, and their numbers: "Cell In[5]" in tracebacks.

IPython keeps that map in a private attribute (``shell.compile._filename_map``); this module is the
one place that reads it, in the kernel and in the ranks forked from it alike.
"""

from __future__ import annotations

import sys


def cell_numbers(shell: object) -> dict[str, int] | None:
    """IPython's own map of ``shell``'s cell files to cell numbers, itself (a rank forked from the
    kernel adds the cells it was sent); None when ``shell`` has none (not IPython, or a newer one)."""
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    return numbers if isinstance(numbers, dict) else None


def cell_labels(shell: object) -> dict[str, str]:
    """Each cell file of ``shell`` with the name tracebacks give it: {".../ipykernel_1/2.py": "Cell In[5]"}."""
    return {name: f"Cell In[{number}]" for name, number in (cell_numbers(shell) or {}).items()}


def running_cell_number(shell: object) -> int:
    """The number the notebook shows for the cell running now.

    IPython files the running cell under its number just before it runs it (the latest entry of its
    map); its ``execution_count`` is that number or, in IPython 9, already the next cell's.
    """
    numbers = cell_numbers(shell)
    if numbers:
        return list(numbers.values())[-1]
    return int(getattr(shell, "execution_count", 0))


def current_shell() -> object:
    """This process's IPython shell, if it has one (a kernel, or a rank forked from it), without importing IPython."""
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None
