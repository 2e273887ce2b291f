"""torch.distributed's backend plugins, looked up once in the kernel instead of once in every rank.

The first ``init_process_group`` of a process looks up the backend it is given (``gloo``,
``nccl``; torch registers even its own this way) among the entry points of every installed
package: 10 to 15 ms of CPU in an environment of a few hundred packages, spent again by every
rank of every run. The kernel (and the fork server) looks once (``find``); each rank answers that
one question from it (``use``), with the very entry points torch would have found.

The answer holds while the folders on ``sys.path`` are unchanged: a rank whose folders changed
since the kernel looked (a ``pip install`` meanwhile) lets torch look for itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_GROUP = "torch.distributed.backends"

_found: Any = None  # importlib.metadata's EntryPoints of that group, once looked up
_looked_at: tuple[tuple[str, int], ...] | None = None  # the folders on sys.path, and when each last changed


def find() -> None:
    """In the kernel or the fork server: the plugins, looked up again only if packages changed since."""
    global _found, _looked_at
    folders = _folders()
    if folders == _looked_at:
        return
    from importlib.metadata import entry_points

    _found = entry_points(group=_GROUP)
    _looked_at = folders


def use() -> None:
    """In a rank, before its cell: torch's question for backend plugins is answered from ``find``."""
    metadata: Any = sys.modules.get("importlib.metadata")
    if metadata is None or _looked_at is None or _folders() != _looked_at:
        return
    look_up, found = metadata.entry_points, _found

    def entry_points(**params: Any) -> Any:
        return found if params == {"group": _GROUP} else look_up(**params)

    metadata.entry_points = entry_points


def _folders() -> tuple[tuple[str, int], ...]:
    """Each folder on sys.path and its modification time: installing a package changes its folder's."""
    stamped = []
    for path in sys.path:
        try:
            stamped.append((path, os.stat(path or ".").st_mtime_ns))
        except OSError:
            continue
    return tuple(stamped)
