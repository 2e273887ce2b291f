"""Test kernels forked from a template that has already imported torch, IPython and ipykernel
(``kernel_template.py``): about 1.6 s of CPU less for each of the hundred kernels the end-to-end tiers
start, on a machine whose two cores those tiers keep busy.

Only a kernel that would import torch at once anyway is forked, and only when the variables it is given
are none that torch or Python read as they start (a kernel given ``OMP_NUM_THREADS`` or ``PYTHONHASHSEED``
starts as jupyter_client starts it). A kernel that must not have torch imported (``bare_kernel``) starts
plainly too. ``TAAS_TESTS_FORKED_KERNELS=0`` starts every kernel plainly.

Each test process (each xdist worker) has one template, started with its first forked kernel and ended
with the process.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from jupyter_client.manager import KernelManager

SWITCH = "TAAS_TESTS_FORKED_KERNELS"
TEMPLATE = os.path.join(os.path.dirname(__file__), "kernel_template.py")
# What a kernel may be given and still be forked: variables read after the start (taas's as the extension
# loads, Gloo's and Ray's when used, CUDA's when CUDA is first used), and those the template sets again.
READ_LATER = ("TAAS_", "GLOO_", "RAY_", "CUDA_VISIBLE_DEVICES", "TMPDIR", "PYTHONPATH")
START_SECONDS = 120.0  # the template imports torch; on a busy machine that takes a while

_template: "Template | None" = None
_lock = threading.Lock()


def forkable(imports: str, extra_env: Mapping[str, str | None]) -> bool:
    """Whether a kernel that runs ``imports`` first, given ``extra_env``, may be forked from the template."""
    return (
        os.environ.get(SWITCH, "1") != "0"
        and "torch" in imports
        and all(name.startswith(READ_LATER) for name in extra_env)
    )


class ForkedKernelManager(KernelManager):
    """A kernel manager whose kernels (and their restarts) are forked from this test process's template;
    everything else is jupyter_client's local provisioner's, which is handed the forked process."""

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        if kernel_cmd[1:3] != ["-m", "ipykernel_launcher"] or os.path.realpath(kernel_cmd[0]) != os.path.realpath(
            sys.executable
        ):
            await super()._async_launch_kernel(kernel_cmd, **kw)
            return
        provisioner: Any = self.provisioner
        cwd = str(kw.get("cwd") or os.getcwd())
        process = template().launch(kernel_cmd, dict(kw["env"]), cwd)
        provisioner.process = process
        provisioner.pid = process.pid
        provisioner.pgid = os.getpgid(process.pid)  # the kernel's own session, as jupyter_client starts it
        provisioner.cwd = cwd
        self._reconcile_connection_info(provisioner.connection_info)


class ForkedProcess:
    """A forked kernel as jupyter_client's local provisioner uses a ``subprocess.Popen``: its process id,
    signals, and how it ended, which the template sends on the kernel's channel."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, channel: socket.socket):
        self.pid = pid
        self.channel = channel
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.channel.setblocking(False)
            try:
                self._ended(self.channel.recv(64))
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.channel.settimeout(timeout)
            try:
                self._ended(self.channel.recv(64))
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def _ended(self, message: bytes) -> None:
        if message.startswith(b"exit "):
            self.returncode = int(message.split()[1])
        else:  # the template went: its kernels leave within a second (ipykernel's parent poller); this one now
            self._kill_quietly()
            self.returncode = -signal.SIGKILL
        self.channel.close()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _kill_quietly(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Template:
    """The template process and this test process's end of its socket pair."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, TEMPLATE, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # an interrupt of the test run is not the template's
        )
        theirs.close()
        self.control = ours
        self.asking = threading.Lock()  # one request, and its answer, at a time
        ours.settimeout(START_SECONDS)
        if ours.recv(16) != b"ready":
            self.close()
            raise RuntimeError("the kernel template did not start")

    def launch(self, cmd: list[str], env: dict[str, str], cwd: str) -> ForkedProcess:
        """A kernel running ``cmd``, forked; it leads a session of its own when this returns."""
        env = {**env, "JPY_PARENT_PID": str(self.process.pid)}  # the kernel leaves if the template goes
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with self.asking, ours, theirs:
            request = json.dumps({"cmd": cmd, "env": env, "cwd": cwd}).encode()
            socket.send_fds(
                self.control, [request], [1, 2, theirs.fileno()]
            )  # stdout, stderr: as a child inherits them
            theirs.close()
            ours.settimeout(START_SECONDS)
            said = ours.recv(64)
            if not said.isdigit():
                raise RuntimeError(f"the kernel template could not start a kernel: {said!r}")
            return ForkedProcess(int(said), ours.dup())

    def close(self) -> None:
        self.control.close()  # the template ends when it reads the end of this
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def template() -> Template:
    """This test process's template, started with the first kernel that needs it."""
    global _template
    with _lock:
        if _template is None or _template.process.poll() is not None:
            _template = Template()
            atexit.register(_template.close)
        return _template
