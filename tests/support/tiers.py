"""Each tier's folder marks its tests, so that ``-m`` selects a tier whatever a module declares, and
says which tests must share a worker when the suite runs in parallel (``pytest -n N --dist loadgroup``).

A tier's conftest binds ``pytest_collection_modifyitems = marks_for(__file__, "name", ...)``: every
test collected under that conftest's folder gets the markers (pyproject.toml lists them) and an
``xdist_group``: its module by default, so a module's tests run in order in one worker and share its
module-scoped fixtures (a kernel, a session); ``group`` puts a whole folder in one worker instead
(the cluster tier, whose modules hand one Ray cluster on from module to module). A test marked
``ray_cluster`` elsewhere starts a Ray cluster of its own: it joins the cluster tier's worker, so
that two clusters never start on this machine at once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def marks_for(conftest: str, *names: str, group: str | None = None) -> Callable[[list[pytest.Item]], None]:
    folder = Path(conftest).resolve().parent

    @pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups into the tests' ids
    def mark(items: list[pytest.Item]) -> None:
        for item in items:
            path = item.path.resolve()
            if folder in path.parents:
                for name in names:
                    item.add_marker(getattr(pytest.mark, name))
                own = "cluster" if item.get_closest_marker("ray_cluster") else str(path.relative_to(folder))
                item.add_marker(pytest.mark.xdist_group(group or own))

    return mark
