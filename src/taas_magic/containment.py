"""Keeping a run's processes inside the run: subreapers, killing by process, dropping inherited sockets.

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
import time
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


def drop_sockets(keep: set[int]) -> None:
    """Replace every inherited socket descriptor not in ``keep`` with /dev/null.

    The kernel's ZeroMQ ports, the fork server's channel, other ranks' delivery sockets: a
    process that keeps them holds them open (a restarted kernel finds its ports taken) and
    could speak on them. ``dup2`` keeps each number taken, so an object in the inherited heap
    that still thinks it owns the number closes /dev/null, never a descriptor opened later.
    """
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in _open_descriptors():
            if fd in keep or fd == null:
                continue
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.dup2(null, fd, inheritable=False)
            except OSError as e:
                if e.errno != errno.EBADF:
                    raise
    finally:
        os.close(null)


def _open_descriptors() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024))
