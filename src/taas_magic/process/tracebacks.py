"""Tracebacks in a rank or producer as IPython shows them in the kernel, naming cells as ``Cell In[5]``.

Forked processes inherit the kernel's line cache and shell; those the fork server started get the
notebook's cells shipped (``register_sources``) before they are forked.
"""

from __future__ import annotations

import linecache
import traceback
from typing import Any

from taas_magic.process import cell_files

_cell_labels: dict[str, str] = {}  # file name -> "Cell In[5]", in processes that unpacked shipped cells


def register_sources(sources: dict[str, tuple[str, str]]) -> None:
    """Make the notebook's cells readable where the kernel's line cache is not inherited (before the
    ranks and producers are forked): tracebacks then quote their lines, and name them as IPython does."""
    numbers = _shell_cell_numbers()
    for filename, (label, code) in sources.items():
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        _cell_labels[filename] = label
        if numbers is not None and label.startswith("Cell In[") and label[8:-1].isdigit():
            numbers[filename] = int(label[8:-1])  # a forked rank's shell: its tracebacks say "Cell In[n]" too


def _shell_cell_numbers() -> dict[str, int] | None:
    """The kernel's own map of cell file names to numbers, in a rank forked from it (None elsewhere)."""
    return cell_files.cell_numbers(cell_files.current_shell())


def format_traceback(error: BaseException, shell: Any) -> list[str]:
    """The traceback as IPython would show it in the kernel, without this module's frame."""
    tb = error.__traceback__.tb_next if error.__traceback__ is not None else None
    try:
        if shell is not None:
            return list(shell.InteractiveTB.structured_traceback(type(error), error, tb))
        lines = _standalone_formatter().structured_traceback(type(error), error, tb)
        for filename, label in _cell_labels.items():
            lines = [line.replace(filename, label) for line in lines]
        return list(lines)
    except Exception:
        return traceback.format_exception(type(error), error, tb)


def _standalone_formatter() -> Any:
    from IPython.core.ultratb import AutoFormattedTB

    try:
        return AutoFormattedTB(mode="Context", theme_name="linux")
    except TypeError:  # IPython 8
        return AutoFormattedTB(mode="Context", color_scheme="Linux")  # type: ignore[call-arg]


def frames_as_dump(error: BaseException) -> str:
    """The frames ``error`` was raised through, written as faulthandler dumps a stack (innermost first):
    where a rank was when its error came, read by the kernel as it reads a stack it asked for."""
    frames = traceback.extract_tb(error.__traceback__)
    return "Current thread (most recent call first):\n" + "\n".join(
        f'  File "{frame.filename}", line {frame.lineno} in {frame.name}' for frame in reversed(frames)
    )
