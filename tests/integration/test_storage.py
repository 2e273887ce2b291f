"""Rank 0's saves: the file appears whole, at once, and a save cut short leaves nothing behind."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile

import pytest
import torch

from taas_magic.rank import storage


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


@pytest.fixture(params=["unnamed", "named"])
def either_way(request, monkeypatch):
    """Each test below runs through the unnamed file and through the named temporary file."""
    if request.param == "named":
        monkeypatch.setattr(storage, "_unnamed_file", lambda folder: None)


def test_a_symlink_is_followed_and_stays_as_in_plain_torch_save(tmp_path, either_way):
    (tmp_path / "target").mkdir()
    link = tmp_path / "link.pt"
    link.symlink_to("target/real.pt")  # dangling at first: the save creates the file it names
    for value in (1.0, 2.0):
        storage.save_whole(torch.save, torch.full((3,), value), str(link))
        assert link.is_symlink() and os.readlink(link) == "target/real.pt"
        assert torch.equal(torch.load(tmp_path / "target" / "real.pt"), torch.full((3,), value))
    assert sorted(os.listdir(tmp_path)) == ["link.pt", "target"] and os.listdir(tmp_path / "target") == ["real.pt"]


def test_an_existing_file_keeps_its_permission_bits(tmp_path, either_way):
    target = tmp_path / "private.pt"
    target.write_bytes(b"old")
    target.chmod(0o600)
    storage.save_whole(write_bytes, b"new", str(target))
    assert target.read_bytes() == b"new" and (target.stat().st_mode & 0o777) == 0o600


def test_a_new_file_gets_the_mode_open_would_give_under_the_umask(tmp_path, either_way):
    previous = os.umask(0o077)
    try:
        storage.save_whole(write_bytes, b"new", str(tmp_path / "model.pt"))
    finally:
        os.umask(previous)
    assert ((tmp_path / "model.pt").stat().st_mode & 0o777) == 0o600


def test_a_file_with_other_hard_links_is_written_into_as_in_plain_torch_save(tmp_path, either_way):
    target, other = tmp_path / "model.pt", tmp_path / "also.pt"
    target.write_bytes(b"old")
    os.link(target, other)
    storage.save_whole(write_bytes, b"new", str(target))
    assert other.read_bytes() == b"new" and target.stat().st_nlink == 2 and target.samefile(other)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another owner")
def test_an_existing_file_keeps_its_owner_and_group(tmp_path, either_way):
    target = tmp_path / "theirs.pt"
    target.write_bytes(b"old")
    os.chown(target, 12345, 23456)
    storage.save_whole(write_bytes, b"new", str(target))
    found = target.stat()
    assert target.read_bytes() == b"new" and (found.st_uid, found.st_gid) == (12345, 23456)


def _as_nobody(work) -> int:
    """Run ``work()`` in a child process as an unprivileged user (root may write anything); its exit code."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            status = work()
        finally:
            os._exit(status)
    _, code = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(code)


def test_a_file_the_process_may_not_write_is_refused_as_plain_torch_save_refuses_it(either_way):
    """Run as an unprivileged user: root may write any file."""
    folder = tempfile.mkdtemp()
    try:
        os.chmod(folder, 0o777)
        target = os.path.join(folder, "read-only.pt")
        with open(target, "wb") as f:
            f.write(b"old")
        os.chmod(target, 0o444)

        def refused_alike() -> int:
            refusals = []
            for save in (torch.save, lambda obj, path: storage.save_whole(torch.save, obj, path)):
                try:
                    save({"w": torch.ones(3)}, target)
                except Exception as e:
                    refusals.append((type(e), "Permission denied" in str(e)))
            same = len(refusals) == 2 and refusals[0] == refusals[1] == (refusals[0][0], True)
            return 0 if same and os.listdir(folder) == ["read-only.pt"] else 2

        assert _as_nobody(refused_alike) == 0
        assert open(target, "rb").read() == b"old"
    finally:
        shutil.rmtree(folder)


def test_the_null_device_is_written_into_and_not_replaced(either_way):
    before = os.stat(os.devnull)
    storage.save_whole(torch.save, {"w": torch.ones(3)}, os.devnull)
    after = os.stat(os.devnull)
    assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_fifo_is_written_into_and_not_replaced(tmp_path, either_way):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader, so that opening it to write does not wait
    try:
        assert storage.save_whole(write_bytes, b"through the pipe", str(fifo)) == 16
        assert os.read(reader, 100) == b"through the pipe"
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a folder and a file of other owners")
def test_a_writable_file_in_a_folder_the_process_may_not_write_is_written_into(either_way):
    folder = tempfile.mkdtemp()
    try:
        target = os.path.join(folder, "shared.pt")
        with open(target, "wb") as f:
            f.write(b"old")
        os.chown(target, 65534, 65534)  # the user's own file, in a folder that is not theirs
        os.chmod(folder, 0o555)
        inode = os.stat(target).st_ino

        def save() -> int:
            storage.save_whole(write_bytes, b"new", target)
            return 0

        assert _as_nobody(save) == 0
        assert open(target, "rb").read() == b"new" and os.stat(target).st_ino == inode
        assert sorted(os.listdir(folder)) == ["shared.pt"]
    finally:
        shutil.rmtree(folder)


def test_set_id_and_sticky_bits_are_kept(tmp_path, either_way):
    target = tmp_path / "model.pt"
    target.write_bytes(b"old")
    target.chmod(0o2754)
    storage.save_whole(write_bytes, b"new", str(target))
    assert target.read_bytes() == b"new" and stat.S_IMODE(target.stat().st_mode) == 0o2754


def test_a_link_that_loops_and_a_path_to_a_folder_fail_as_in_plain_torch_save(tmp_path, either_way):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    for path in (str(tmp_path / "a"), str(tmp_path / "model.pt") + os.sep):
        refusals = []
        for save in (torch.save, lambda obj, p: storage.save_whole(torch.save, obj, p)):
            with pytest.raises(Exception) as caught:
                save({"w": torch.ones(1)}, path)
            refusals.append(type(caught.value))
        assert refusals[0] is refusals[1], path
    assert sorted(os.listdir(tmp_path)) == ["a", "b"] and (tmp_path / "a").is_symlink()


def test_a_file_that_may_not_be_replaced_is_written_into(tmp_path, monkeypatch):
    """An append-only or immutable file refuses the rename over it: plain torch.save takes over."""

    def refused(fd, path):
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(storage, "_link_into_place", refused)
    target = tmp_path / "model.pt"
    target.write_bytes(b"old")
    inode = target.stat().st_ino
    storage.save_whole(write_bytes, b"new", str(target))
    assert target.read_bytes() == b"new" and target.stat().st_ino == inode and os.listdir(tmp_path) == ["model.pt"]
