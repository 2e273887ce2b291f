"""The tests' kernel driver (support/kernel.py) explains a cell that does not finish: where the kernel
was, what the cell said once interrupted, or how the kernel died; and the kernel is free again after."""

from __future__ import annotations

import os
import signal
import socket
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


def test_a_kernel_whose_port_was_taken_before_it_bound_it_starts_again_on_others(monkeypatch):
    """jupyter_client frees the ports it picks for the kernel to bind: another process can take one first."""
    import support.kernel
    from jupyter_client.manager import KernelManager
    from support.kernel import Kernel

    made: list[KernelManager] = []

    class FirstOnATakenPort(KernelManager):
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            if not made:
                self.cache_ports = False
                self.shell_port = taken.getsockname()[1]
            made.append(self)

    with socket.create_server(("127.0.0.1", 0)) as taken:
        monkeypatch.setattr(support.kernel, "KernelManager", FirstOnATakenPort)
        k = Kernel(imports="import sys", warm_fork_server=False)
        try:
            assert len(made) == 2 and not made[0].is_alive() and k.value("1 + 1") == 2
        finally:
            k.shutdown()
