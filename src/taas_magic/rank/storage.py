"""Only rank 0 writes to the project folder, as in the original service.

In other ranks ``torch.save`` to a file path is skipped (reported once per cell by the
controller); in rank 0 it writes to an unnamed file in the target's folder and links it into
place, so the file appears once, whole, and a save cut short leaves nothing. Otherwise the
result is plain ``torch.save``'s: symlinks are followed, permission bits and owner kept, and a
device, a FIFO, a file with other hard links or one this process may not write is written into
(or refused) as plain ``torch.save`` does. Saving to a file object or buffer is left alone everywhere.
"""

from __future__ import annotations

import os
import stat
import sys
from typing import Any, Callable

from taas_magic.wire.records import SavedOnNode, SaveSkipped

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

    What a user sees is what plain ``torch.save`` gives: a symlink's file is written and the
    link stays, a file keeps its permission bits and owner (a new one gets those ``open()``
    would give). Where a new file could not be the same one to its users (a device or FIFO such
    as ``os.devnull``, a file with other hard links, one owned by someone this process cannot
    give a file to), where no new file can be made (a folder the process may not write, a file
    that may not be replaced), or where plain ``torch.save`` would fail (a file this process may
    not write, a link that loops, a path that ends in a slash), the file is written into, or
    refused, by plain ``torch.save`` itself.
    """
    target = os.path.realpath(path)  # open() follows links: the file they name is the one written
    existing = _stat_or_none(target)
    if not _replaceable(path, target, existing):
        return save(obj, path, *args, **kwargs)
    try:
        fd = _unnamed_file(os.path.dirname(target))
    except PermissionError:
        return save(obj, path, *args, **kwargs)
    if fd is None:
        return _save_through_named_file(save, obj, target, existing, *args, **kwargs)
    try:
        result = save(obj, f"/proc/self/fd/{fd}", *args, **kwargs)  # the save opens it by path, as any path
        if existing is not None:  # after the save, which reopens the file and must still be allowed to
            _take_over(existing, fd)
        try:
            _link_into_place(fd, target)
        except PermissionError:  # the file may not be replaced (append-only, immutable): write into it
            return save(obj, path, *args, **kwargs)
        return result
    finally:
        os.close(fd)


def _replaceable(path: str, target: str, existing: os.stat_result | None) -> bool:
    """Whether a new file at ``target`` (what ``path`` names) is, to its users, the file written again."""
    if path.endswith(os.sep) or os.path.islink(target):  # a path to a folder, or a link that loops
        return False
    if not os.access(os.path.dirname(target), os.W_OK | os.X_OK):
        return False
    if existing is None:
        return True
    return (
        stat.S_ISREG(existing.st_mode)
        and existing.st_nlink == 1
        and os.access(target, os.W_OK)
        and _may_give(existing.st_uid, existing.st_gid)
    )


def _may_give(uid: int, gid: int) -> bool:
    """Whether this process may make a file of its own belong to ``uid`` and ``gid``."""
    if os.geteuid() == 0:
        return True
    return uid == os.geteuid() and (gid == os.getegid() or gid in os.getgroups())


def _take_over(existing: os.stat_result, new: int | str) -> None:
    """Give the ``new`` file (a descriptor or a path) the old one's owner and mode, set-id and
    sticky bits too (after the owner: a change of owner clears the set-id bits)."""
    os.chown(new, existing.st_uid, existing.st_gid)
    os.chmod(new, stat.S_IMODE(existing.st_mode))


def _stat_or_none(path: str) -> os.stat_result | None:
    """What is at ``path`` now, or None where nothing is (or it cannot be seen: the save then says why)."""
    try:
        return os.stat(path)
    except OSError:
        return None


def _unnamed_file(folder: str) -> int | None:
    """A file without a name in ``folder``, or None where this system or file system has none.

    Its mode is 0666 less the umask, as a file that ``open()`` creates. Raises PermissionError
    where the folder takes no new file (an immutable one).
    """
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666)
    except PermissionError:
        raise
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


def _save_through_named_file(
    save: Callable[..., Any], obj: Any, path: str, existing: os.stat_result | None, *args: Any, **kwargs: Any
) -> Any:
    """Save to a temporary name beside ``path``, give it the ``existing`` file's owner and mode,
    and rename it over ``path``."""
    temporary = _temporary_name(path)
    try:
        result = save(obj, temporary, *args, **kwargs)
        if existing is not None:
            _take_over(existing, temporary)
        os.replace(temporary, path)
        return result
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _temporary_name(path: str) -> str:
    return os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.taas-tmp")
