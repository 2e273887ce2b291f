"""Containment on its own: a subreaper ends whatever its children left, however they detached."""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import stat
import time

import psutil
import pytest

from taas_magic.process import containment

ESCAPES = """
import os, subprocess, time
subprocess.Popen(["sleep", "60"], start_new_session=True)  # a new session
if os.fork() == 0:  # a classic daemon: fork, setsid, fork again, parent exits
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    os._exit(0)
"""


def test_a_subreaper_ends_new_sessions_and_double_forked_daemons():
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            containment.become_subreaper()
            escaper = os.fork()
            if escaper == 0:
                exec(compile(ESCAPES, "<escapes>", "exec"), {})
                os._exit(0)
            os.waitpid(escaper, 0)
            time.sleep(0.3)  # the daemon's parent has exited: the daemon is ours now
            found = containment.descendants(os.getpid())
            os.write(write_end, f"\n{' '.join(map(str, found))}\n".encode())
            left = containment.end_all_children(5.0)
            status = 0 if not left and not containment.children() else 2
        finally:
            os._exit(status)
    os.close(write_end)
    _, code = os.waitpid(pid, 0)
    lines = os.read(read_end, 4096).decode().split("\n")
    os.close(read_end)
    adopted = [int(p) for p in lines[-2].split()]
    assert os.waitstatus_to_exitcode(code) == 0
    assert len(adopted) >= 2, "the new-session child and the orphaned daemon were both adopted"
    for gone in adopted:
        assert not psutil.pid_exists(gone) or psutil.Process(gone).status() == psutil.STATUS_ZOMBIE


def test_descendants_are_listed_parents_first():
    child = psutil.Popen(["sh", "-c", "sleep 30 & sleep 30"])
    try:
        deadline = time.monotonic() + 5
        while len(containment.descendants(os.getpid())) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        found = containment.descendants(os.getpid())
        assert found[0] == child.pid and len(found) >= 3
    finally:
        for pid in reversed(containment.descendants(os.getpid())):
            containment.kill(pid, signal.SIGKILL)
        child.wait()


def test_dropping_sockets_keeps_numbers_taken_and_the_chosen_ones_open():
    keep, drop = socket.socketpair()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            containment.drop_sockets({keep.fileno()})
            dropped = [fd for fd in (drop.fileno(), listener.fileno()) if stat.S_ISSOCK(os.fstat(fd).st_mode)]
            kept = stat.S_ISSOCK(os.fstat(keep.fileno()).st_mode)
            pipe_kept = stat.S_ISFIFO(os.fstat(read_end).st_mode)
            status = 0 if not dropped and kept and pipe_kept else 2
        finally:
            os._exit(status)
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    listener.close()
    with socket.socket() as again:  # the child never held the port past its own end
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
    for thing in (keep, drop):
        thing.close()
    os.close(read_end)
    os.close(write_end)


def test_dropping_what_was_inherited_takes_the_kernels_machinery_and_leaves_what_a_cell_made(tmp_path):
    output_pipe, cells_pipe = os.pipe(), os.pipe()
    event = select.epoll()
    sock, other = socket.socketpair()
    history = open(tmp_path / "history.sqlite", "w")
    saved_stdout = open(tmp_path / "terminal", "w")
    notes = open(tmp_path / "notes.txt", "w")
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            link = lambda fd: os.readlink(f"/proc/self/fd/{fd}")  # noqa: E731
            containment.drop_inherited(
                {other.fileno()},
                also={saved_stdout.fileno()},
                targets={link(output_pipe[0]), os.path.realpath(history.name)},
            )
            dropped = [
                _dead_end(fd)
                for fd in (*output_pipe, event.fileno(), sock.fileno(), history.fileno(), saved_stdout.fileno())
            ]
            kept = [link(fd).startswith(("pipe:", "socket:")) for fd in (*cells_pipe, other.fileno())]
            status = 0 if all(dropped) and all(kept) and link(notes.fileno()).endswith("notes.txt") else 2
        finally:
            os._exit(status)
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    for fd in (*output_pipe, *cells_pipe):
        os.close(fd)
    for thing in (event, sock, other, history, saved_stdout, notes):
        thing.close()


def _dead_end(fd: int) -> bool:
    """Whether reading and writing ``fd`` both fail with EBADF, as on a dropped descriptor."""
    for use in (lambda: os.read(fd, 1), lambda: os.write(fd, b"x")):
        try:
            use()
            return False
        except OSError as e:
            if e.errno != errno.EBADF:
                return False
    return True


def test_a_close_cut_by_an_interrupt_at_its_very_call_is_run_again_then_the_interrupt_raised() -> None:
    calls: list[str] = []

    def close() -> None:
        calls.append("close")
        if len(calls) == 1:
            raise KeyboardInterrupt  # as Python raises a pending one when the function begins

    with pytest.raises(KeyboardInterrupt):
        containment.close_whole(close)
    assert calls == ["close", "close"]
    containment.close_whole(lambda: calls.append("quiet"))  # no interrupt: nothing raised
    assert calls[-1] == "quiet"
