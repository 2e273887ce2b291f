"""The tests' kernel driver (support/kernel.py) explains a cell that does not finish: where the kernel
was, what the cell said once interrupted, or how the kernel died; and the kernel is free again after."""

from __future__ import annotations

import os
import signal
import threading

import pytest


def test_a_cell_that_does_not_finish_says_where_the_kernel_was_and_is_stopped(kernel):
    with pytest.raises(TimeoutError) as stuck:
        kernel.execute("print('before', flush=True)\ndef napping():\n    time.sleep(100)\nnapping()", timeout=2)
    said = str(stuck.value)
    assert said.startswith("cell did not finish in 2 s"), said
    assert "in napping" in said.split("what the cell said:")[0], "the kernel's main thread, in the cell"
    assert "before\n\n(interrupted here)" in said and "KeyboardInterrupt" in said
    assert kernel.execute("print('next')").ok().stdout == "next\n", "the next cell does not wait behind it"


def test_a_cell_whose_kernel_died_says_how_it_ended(fresh_kernel):
    threading.Timer(0.5, os.kill, (fresh_kernel.pid, signal.SIGKILL)).start()
    with pytest.raises(TimeoutError) as stuck:
        fresh_kernel.execute("time.sleep(100)", timeout=2)
    assert "the kernel died (exit status -9" in str(stuck.value)
