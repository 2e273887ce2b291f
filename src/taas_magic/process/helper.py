"""A helper process of taas's own beside the kernel (the fork server, a cluster connection's driver): how it
is started, how it reads its channel's secret, and what the kernel reads of it when it died.

A helper runs ``python -m MODULE FD``: FD is its end of a socket pair with the kernel, which it passes by
number, and the channel's secret comes on its standard input, so that it appears in no command line and no
environment. It starts in a session of its own (the kernel's interrupts are the kernel's to pass on), not
under the notebook's debugger, and its standard error goes to an anonymous memory file: nothing is left on
disk, and the kernel reads the tail when the helper died to say why.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from taas_magic.process import kernel_debugger
from taas_magic.wire import channel, memfile

SECRET_SIZE = 32  # bytes of the channel's secret on standard input


@dataclass
class Helper:
    """A started helper: its process, the kernel's end of their socket pair, the channel's secret, and the
    memory file that holds its standard error."""

    process: subprocess.Popen[bytes]
    sock: socket.socket
    secret: bytes
    stderr: int

    def stderr_tail(self, size: int) -> str:
        """The last ``size`` bytes the helper wrote to its standard error, as text."""
        length = os.fstat(self.stderr).st_size
        return os.pread(self.stderr, size, max(0, length - size)).decode("utf-8", "replace")

    def ended(self, seconds: float) -> None:
        """Once its channel is closed (the helper's word to end): wait ``seconds`` for it to exit, kill it if it
        lingers, and let go of its standard error."""
        try:
            self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        finally:
            os.close(self.stderr)


def start(module: str, name: str) -> Helper:
    """``python -m module FD`` started with a new channel's end and secret; ``name`` (``fork-server``) names its
    standard error's memory file."""
    kernel_sock, helper_sock = channel.socket_pair()
    secret = channel.new_secret()
    stderr = memfile.new_file(f"taas-{name}-stderr", 0)
    try:
        with kernel_debugger.plain_subprocesses():  # it does not join the notebook's debugging session
            process = subprocess.Popen(
                [sys.executable, "-m", module, str(helper_sock.fileno())],
                pass_fds=[helper_sock.fileno()],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # the kernel's interrupts reach it only as the kernel passes them on
            )
        assert process.stdin is not None
        process.stdin.write(secret)
        process.stdin.close()
    except BaseException:
        kernel_sock.close()
        os.close(stderr)
        raise
    finally:
        helper_sock.close()
    return Helper(process, kernel_sock, secret, stderr)


def ending(code: int) -> str:
    """How a process with exit status ``code`` (``Popen.returncode``) ended, as taas says it."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def read_secret(name: str) -> bytes:
    """In the helper: its channel's secret, from standard input; ``name`` says who lacks it."""
    secret = b""
    while len(secret) < SECRET_SIZE:
        chunk = os.read(0, SECRET_SIZE - len(secret))
        if not chunk:
            raise SystemExit(f"taas {name}: no channel secret on standard input")
        secret += chunk
    return secret
