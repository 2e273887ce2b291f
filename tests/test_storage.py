"""Rank 0's saves: the file appears whole, at once, and a save cut short leaves nothing behind."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from taas_magic import storage


def write_bytes(obj: bytes, path: str) -> int:
    with open(path, "wb") as f:
        return f.write(obj)


def test_a_save_creates_or_replaces_the_file_whole_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "model.pt"
    storage.save_whole(torch.save, {"w": torch.ones(3)}, str(target))
    assert torch.equal(torch.load(target)["w"], torch.ones(3))
    storage.save_whole(torch.save, {"w": torch.zeros(3)}, str(target))
    assert torch.equal(torch.load(target)["w"], torch.zeros(3))
    assert os.listdir(tmp_path) == ["model.pt"]
    assert (target.stat().st_mode & 0o777) == 0o666 & ~_umask(), "an ordinary file"


def test_a_failing_save_leaves_the_old_file_and_nothing_else(tmp_path):
    target = tmp_path / "model.pt"
    target.write_bytes(b"old")

    def failing(obj, path):
        write_bytes(b"half", path)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        storage.save_whole(failing, None, str(target))
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["model.pt"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_process_killed_in_the_middle_of_a_save_leaves_nothing(tmp_path, signum):
    def killed(obj, path):
        write_bytes(b"half", path)
        os.kill(os.getpid(), signum)

    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a rank
        try:
            storage.save_whole(killed, None, str(tmp_path / "model.pt"))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -signum
    assert os.listdir(tmp_path) == []


def test_without_unnamed_files_a_named_temporary_file_is_used_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "_unnamed_file", lambda folder: None)
    seen = []

    def saving(obj, path):
        seen.append(os.path.basename(path))
        return write_bytes(obj, path)

    target = tmp_path / "model.pt"
    assert storage.save_whole(saving, b"new", str(target)) == 3
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["model.pt"]
    assert seen == [f".model.pt.{os.getpid()}.taas-tmp"]


def test_a_missing_folder_is_reported_by_the_save_itself(tmp_path):
    with pytest.raises(RuntimeError, match="does not exist"):
        storage.save_whole(torch.save, {}, str(tmp_path / "missing" / "model.pt"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
