"""This process's open file descriptors, for tests that check an operation keeps none."""

from __future__ import annotations

import gc
import os


def open_descriptors() -> set[str]:
    """The descriptors open now, counted after a garbage collection: a socket or file that an earlier
    test in this process dropped in a reference cycle would otherwise close in the middle of a count."""
    gc.collect()
    return set(os.listdir("/proc/self/fd"))
