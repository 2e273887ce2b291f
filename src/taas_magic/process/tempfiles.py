"""multiprocessing's temporary folders in ranks and producers: named for the process, gone with it.

multiprocessing makes a folder per process in the temporary folder (``pymp-*``) when it first
needs one; DataLoader workers put there the sockets through which they hand tensors to their
parent. An exit handler removes it, and that never runs in the processes of a run: ranks and
producers end with ``os._exit``, and their workers are killed. So in a rank or a producer the
folders that process and its forked children make are named after it (``pymp-taas-PID-*``),
and the process removes them all as it ends; whoever reaps a process that was killed can
remove them by its pid too.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from typing import Any

PREFIX = "pymp-taas-"
_may_have_folders = False  # whether this process made one, or forked a child that might have


def _note_folders() -> None:
    global _may_have_folders
    _may_have_folders = True


def name_multiprocessing_folders() -> None:
    """First thing in a rank or producer: folders made here and in forked children carry this pid."""
    from multiprocessing import util

    owner = os.getpid()

    def get_temp_dir() -> str:
        config = _config()
        if config.get("tempdir") is None:
            _note_folders()
            folder = tempfile.mkdtemp(prefix=f"{PREFIX}{owner}-")
            # A child that ends normally still removes its own folder, as multiprocessing does.
            util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True}, exitpriority=-100)
            config["tempdir"] = folder
        return str(config["tempdir"])

    _config()["tempdir"] = None  # a folder the kernel made is the kernel's to remove
    util.get_temp_dir = get_temp_dir
    os.register_at_fork(before=_note_folders)  # DataLoader workers make their folders themselves


def remove_multiprocessing_folders() -> None:
    """Last thing in a rank or producer, once its children are gone: its folders and theirs go.

    A process that made no folder and forked no child has none to look for (the look is a
    listing of the whole temporary folder).
    """
    _config()["tempdir"] = None
    if _may_have_folders:
        remove_folders_of(os.getpid())


def remove_folders_of(pid: int) -> None:
    """In the process that reaps rank or producer ``pid``: what it could not remove, being killed."""
    for folder in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{PREFIX}{pid}-*")):
        shutil.rmtree(folder, ignore_errors=True)


def _config() -> dict[str, Any]:
    from multiprocessing import process

    config: dict[str, Any] = getattr(process.current_process(), "_config")  # multiprocessing's own settings
    return config
