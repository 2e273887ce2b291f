"""Each tier's folder marks its tests, so that ``-m`` selects a tier whatever a module declares.

A tier's conftest binds ``pytest_itemcollected = marks_for(__file__, "name", ...)``: every test
collected under that conftest's folder gets the markers (pyproject.toml lists them) as it is
collected, before ``-m`` selects.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def marks_for(conftest: str, *marks: str | pytest.MarkDecorator) -> Callable[[pytest.Item], None]:
    """The hook that marks each test under ``conftest``'s folder: a marker's name, or a marker itself."""
    folder = Path(conftest).resolve().parent

    def mark(item: pytest.Item) -> None:
        if folder in item.path.resolve().parents:
            for each in marks:
                item.add_marker(getattr(pytest.mark, each) if isinstance(each, str) else each)

    return mark
