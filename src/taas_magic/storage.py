"""Only rank 0 writes to the project folder, as in the original service.

In other ranks ``torch.save`` to a file path is skipped (reported once per cell by the
controller); in rank 0 it writes to a temporary file beside the target and renames it, so the
file appears once, whole. Saving to a file object or buffer is left alone everywhere.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

Notify = Callable[[dict[str, Any]], None]


def guard_torch_save(rank: int, notify: Notify, namespace: dict[str, Any] | None) -> None:
    """Replace ``torch.save`` in this rank (and names in ``namespace`` bound to it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    original = torch.save
    skipped: set[str] = set()

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(f, (str, bytes, os.PathLike)):
            return original(obj, f, *args, **kwargs)
        path = os.fsdecode(f)
        if rank != 0:
            if path not in skipped:
                skipped.add(path)
                notify({"notice": "save-skipped", "path": path})
            return None
        return save_whole(original, obj, path, *args, **kwargs)

    save.__doc__ = original.__doc__
    torch.save = save
    for name, value in list((namespace or {}).items()):
        if value is original:
            namespace[name] = save


def save_whole(save: Callable[..., Any], obj: Any, path: str, *args: Any, **kwargs: Any) -> Any:
    """Write through a temporary file in the same folder, then rename: readers never see half a file."""
    temporary = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.taas-tmp")
    try:
        result = save(obj, temporary, *args, **kwargs)
        os.replace(temporary, path)
        return result
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
