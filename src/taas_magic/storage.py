"""Only rank 0 writes to the project folder, as in the original service.

In other ranks ``torch.save`` to a file path is skipped (reported once per cell by the
controller); in rank 0 it writes to an unnamed file in the target's folder and links it into
place, so the file appears once, whole, and a save cut short leaves nothing. Saving to a file
object or buffer is left alone everywhere.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from .records import SavedOnNode, SaveSkipped

Notify = Callable[[SaveSkipped | SavedOnNode], None]


def guard_torch_save(rank: int, notify: Notify, node: str | None = None) -> tuple[Any, Any] | None:
    """Replace ``torch.save`` in this rank; returns (the original, its replacement), for the notebook's own names.

    ``node``: the address of the cluster node this rank runs on. Rank 0's files come back to the
    notebook from its run folder (its working directory) alone; a save elsewhere is reported.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    original = torch.save
    skipped: set[str] = set()

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(f, (str, bytes, os.PathLike)):
            return original(obj, f, *args, **kwargs)
        path = os.fsdecode(f)
        if rank != 0:
            if path not in skipped:
                skipped.add(path)
                notify(SaveSkipped(path))
            return None
        if node is not None and path not in skipped and not _inside(os.getcwd(), path):
            skipped.add(path)
            notify(SavedOnNode(os.path.abspath(path), node))
        return save_whole(original, obj, path, *args, **kwargs)

    save.__doc__ = original.__doc__
    setattr(torch, "save", save)
    return original, save


def _inside(folder: str, path: str) -> bool:
    return os.path.commonpath([os.path.realpath(folder), os.path.realpath(path)]) == os.path.realpath(folder)


def save_whole(save: Callable[..., Any], obj: Any, path: str, *args: Any, **kwargs: Any) -> Any:
    """Write to a file without a name in the target's folder, then link it into place.

    Readers never see half a file, and a rank stopped in the middle of a save, even by
    SIGKILL, leaves nothing behind: a file opened with ``O_TMPFILE`` has no name until it is
    linked, and the system frees it with the last descriptor. Where the folder's file system
    has no ``O_TMPFILE``, a named temporary file is used and removed on every way out that
    runs code.
    """
    fd = _unnamed_file(os.path.dirname(path) or ".")
    if fd is None:
        return _save_through_named_file(save, obj, path, *args, **kwargs)
    try:
        result = save(obj, f"/proc/self/fd/{fd}", *args, **kwargs)  # the save opens it by path, as any path
        _link_into_place(fd, path)
        return result
    finally:
        os.close(fd)


def _unnamed_file(folder: str) -> int | None:
    """A file without a name in ``folder``, or None where this system or file system has none."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    except OSError:  # not on this file system; a missing folder is then reported by the save itself
        return None


def _link_into_place(fd: int, path: str) -> None:
    """Give the unnamed file ``fd`` the name ``path``, replacing what is there in one step."""
    links = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.link(str(fd), path, src_dir_fd=links, follow_symlinks=True)  # linkat(AT_SYMLINK_FOLLOW)
            return
        except FileExistsError:
            pass
        # A link cannot replace a file: link under a temporary name, then rename over the target.
        temporary = _temporary_name(path)
        os.link(str(fd), temporary, src_dir_fd=links, follow_symlinks=True)
        try:
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    finally:
        os.close(links)


def _save_through_named_file(save: Callable[..., Any], obj: Any, path: str, *args: Any, **kwargs: Any) -> Any:
    temporary = _temporary_name(path)
    try:
        result = save(obj, temporary, *args, **kwargs)
        os.replace(temporary, path)
        return result
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _temporary_name(path: str) -> str:
    return os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.taas-tmp")
