"""This process's open file descriptors, for tests that check an operation leaves none open."""

from __future__ import annotations

import gc
import os

Descriptor = tuple[str, str]  # its number and what it refers to ("socket:[123]", a file's path)


def open_descriptors() -> set[Descriptor]:
    """The descriptors open now, each with what it refers to, counted after a garbage collection: a socket
    or file an earlier test dropped in a reference cycle would otherwise close in the middle of a count."""
    gc.collect()
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return found


def opened_since(before: set[Descriptor]) -> set[Descriptor]:
    """What is open now that was not ``before``. Descriptors that closed meanwhile do not count: another
    thread of the process (a test worker's own) may close one of its own at any time; a number reused for
    something else counts as new."""
    return open_descriptors() - before
