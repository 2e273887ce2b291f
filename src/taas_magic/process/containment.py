"""Keeping a run's processes inside the run: subreapers, killing by process, dropping inherited descriptors.

Process groups and sessions are no boundary: a rank's child may call ``setsid``, double-fork,
or join another group. What cannot be escaped is ancestry under a *subreaper*: an orphan is
re-parented to its nearest subreaper ancestor, so every process a run ever starts stays a
descendant of the run's supervisor for as long as the supervisor lives. Ending a run is then
"kill every child, reap, repeat until none is left", by process id, never by group.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import stat
import threading
import time
from types import FrameType, TracebackType
from typing import Callable, Collection

PR_SET_CHILD_SUBREAPER = 36

_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up once, used in forked children
except (AttributeError, OSError):
    _prctl = None


def become_subreaper() -> None:
    """Orphans of this process's descendants become its children instead of init's."""
    if _prctl is not None:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)


def children(pid: int | None = None) -> list[int]:
    """Direct children of ``pid`` (this process by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as listing:
                found += [int(child) for child in listing.read().split()]
        except FileNotFoundError:
            return _children_by_scan(pid)  # a kernel built without CONFIG_PROC_CHILDREN
        except OSError:
            pass
    return found


def _children_by_scan(pid: int) -> list[int]:
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, parents before their children."""
    found: list[int] = []
    pending = [pid]
    while pending:
        below = children(pending.pop())
        found += below
        pending += below
    return found


def kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(leader: int, signum: int) -> None:
    """``signum`` to the process group that ``leader`` leads (or led: a zombie's group is still its own)."""
    try:
        os.killpg(leader, signum)
    except (ProcessLookupError, PermissionError):
        pass


def signal_tree(pid: int, signum: int) -> None:
    """``signum`` to a process that leads its group (a rank and its DataLoader workers…), and to the process
    itself wherever it went; SIGKILL also to every descendant by process id: a group is no boundary for a
    process that left it. ``pid`` must be a live child or a zombie not yet reaped (else it may be another's)."""
    try:
        leads_its_group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return
    below = descendants(pid) if signum == signal.SIGKILL else []
    if leads_its_group:
        kill_group(pid, signum)
    else:
        kill(pid, signum)
    for other in below:
        kill(other, signum)


def to_the_end(*steps: Callable[[], object]) -> bool:
    """Run each step to its end, again when an interrupt cut it short (each must bear running
    twice); whether one did. For freeing what a run holds: half-freed is leaked for good."""
    interrupted = False
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt:
                interrupted = True
    return interrupted


def close_whole(close: Callable[[], object]) -> None:
    """``close()`` run to its end whatever interrupts come, one at its very call included (Python takes
    a pending interrupt as a function begins, before its first line could guard against it); an
    interrupt that came is raised once all is closed. For a run's group of processes: half-closed
    leaves a supervisor unreaped, its descriptors and the store's port open, for good."""
    if to_the_end(close):
        raise KeyboardInterrupt


class _Held:
    """From its making until ``release``, ``signum`` in this process only records that it came; what it
    would have done is done at the release (``_resume``)."""

    signum: signal.Signals

    def __init__(self) -> None:
        self.came = False
        self._previous = signal.getsignal(self.signum)
        # Not where the handler was set outside Python, or off the main thread: there it cannot be put back.
        self._held = self._previous is not None and threading.current_thread() is threading.main_thread()
        if self._held:
            signal.signal(self.signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.came = True

    def release(self) -> None:
        """Put the handler back; a signal that came meanwhile takes effect now, or, where the handler put
        back is an outer hold's, as that one is released: holds nest, the outermost acts."""
        if self._held:
            self._held = False
            signal.signal(self.signum, self._previous)
        if self.came:
            self.came = False
            outer = getattr(self._previous, "__self__", None)
            if isinstance(outer, _Held):
                outer.came = True
            else:
                self._resume()

    def _resume(self) -> None:
        raise NotImplementedError


class HeldTermination(_Held):
    """SIGTERM held, for a rank whose cell failed on its own: it finishes saying so (its traceback is
    formatted and sent) before the stop taas began for another rank's failure ends it. Several ranks
    that fail alike are then shown once, labelled with all of them. SIGKILL, 3 s later, still ends it.
    """

    signum = signal.SIGTERM

    def _resume(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class HeldInterrupts(_Held):
    """SIGINT held, for steps an interrupt must not cut, and must not be lost in; raised at the release.

    ``os.fork``: at-fork callbacks (logging's, for one) run Python inside it, and an interrupt raised
    there is reported and swallowed (the cell would run on as if never interrupted); one raised as
    the fork returns would lose the new pid. Sending a session's cell: it must go whole or not at
    all. Blocking the signal would not do: the kernel's other threads take it, and Python runs the
    handler in the main thread all the same. A forked child keeps recording until it sets handlers
    of its own.
    """

    signum = signal.SIGINT

    def _resume(self) -> None:
        raise KeyboardInterrupt

    def __enter__(self) -> "HeldInterrupts":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        """Released on the way out; a failure inside says more than an interrupt that came meanwhile."""
        if kind is not None:
            self.came = False
        self.release()


class ForwardedInterrupts(HeldInterrupts):
    """SIGINT held, and passed on at once to process ``pid``, which acts on it: for the kernel waiting for
    its cluster driver's answer, which an interrupt cuts short there (the driver answers with the
    interrupt) or does not (an answer that came first). Held here, so the wait is never cut in the middle
    of a message; the waiting code reads ``came`` and clears it where the answer said it all."""

    def __init__(self, pid: int) -> None:
        self.pid = pid  # before the handler is set: it may run at once
        super().__init__()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.came = True
        try:
            os.kill(self.pid, signal.SIGINT)
        except ProcessLookupError:
            pass  # gone: the wait finds its channel closed


def end_all_children(timeout: float, spare: Collection[int] = ()) -> list[int]:
    """Kill and reap every child of this (subreaper) process except ``spare``, and whatever they leave.

    Killing a child re-parents its own children to us; the loop goes on until none is left or
    ``timeout`` passes. Returns what could not be ended in time (nothing, unless the system is stuck).
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in children() if pid not in spare]
        for pid in alive:
            kill(pid, signal.SIGKILL)
        reap_strays(spare)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.005)


def reap(pid: int, options: int = 0) -> None:
    """Collect a child's exit status (at once with ``os.WNOHANG``); nothing if another already did."""
    try:
        os.waitpid(pid, options)
    except ChildProcessError:
        pass


def end_child(pid: int) -> None:
    """Kill a child of this process and reap it, whatever interrupts come meanwhile."""
    to_the_end(lambda: kill(pid, signal.SIGKILL), lambda: reap(pid))


def reap_strays(spare: Collection[int] = ()) -> None:
    """Reap dead children that are not in ``spare`` (whose exit statuses belong to someone else)."""
    for pid in children():
        if pid not in spare:
            reap(pid, os.WNOHANG)


def drop_sockets(keep: Collection[int]) -> None:
    """Make every inherited socket not in ``keep`` a dead end (see ``drop_inherited``).

    For the supervisor: its pipes to the ranks are its own, the kernel's ports are not.
    """
    _replace_with_dead_end(keep, lambda fd: stat.S_ISSOCK(os.fstat(fd).st_mode))


def drop_inherited(keep: Collection[int], also: Collection[int] = (), targets: Collection[str] = ()) -> None:
    """Make a dead end of every inherited descriptor not in ``keep`` that ties this process to the
    kernel's machinery.

    Dropped: sockets (the kernel's ZeroMQ ports, the fork server's channel, other ranks' delivery
    sockets), event and poll descriptors (ZeroMQ's and asyncio's, shared with the kernel), memory
    files, the numbers in ``also`` and whatever ``targets`` names as ``/proc/self/fd`` does (the
    kernel's captured-output pipes, its history database). A process that kept them would hold
    the kernel's ports open, read or write its streams, or change its event loops. What a cell
    made stays: its files, and its pipes (a ``multiprocessing.Queue`` the notebook made is still
    the ranks' way to send it something). A socket, memory file or event descriptor a cell made
    goes too: using it in a rank fails, it never loses data in silence.
    """
    _replace_with_dead_end(keep, lambda fd: fd in also or _ties_to_the_kernel(fd, targets))


def drop_all_but(keep: Collection[int]) -> None:
    """Make a dead end of every descriptor but ``keep`` and the standard three: for a process forked to do one thing
    (a run's store), which must hold nothing of its parent's open."""
    _replace_with_dead_end(keep, lambda fd: True)


def _replace_with_dead_end(keep: Collection[int], drop: Callable[[int], bool]) -> None:
    """``dup2`` a dead end onto each descriptor to drop: every read, write or poll on it fails with
    EBADF (an ``O_PATH`` descriptor; /dev/null where there is none), so a stale object of the
    inherited heap fails loudly instead of writing into nothing. The number stays taken: such an
    object closes the dead end, never a descriptor opened later."""
    if hasattr(os, "O_PATH"):
        dead_end = os.open("/", os.O_PATH | os.O_CLOEXEC)
    else:
        dead_end = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in _open_descriptors():
            if fd < 3 or fd == dead_end or fd in keep:
                continue
            try:
                if drop(fd):
                    os.dup2(dead_end, fd, inheritable=False)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise
    finally:
        os.close(dead_end)


_MACHINERY_KINDS = ("socket:", "anon_inode:", "/memfd:")


def _ties_to_the_kernel(fd: int, targets: Collection[str]) -> bool:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: what fstat can tell
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    return target.startswith(_MACHINERY_KINDS) or target in targets


def _open_descriptors() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024))
