"""A template for the tests' kernels: a process that has imported what every kernel of the tests imports
(torch, IPython, ipykernel) and forks a kernel on request, so that a kernel starts in a fraction of a
second of CPU instead of about two (``support.forked_kernels`` is the other end).

Run as a script with one argument, the descriptor of its end of a socket pair to the test process. Each
request on it is one message, JSON ``{"cmd": [...], "env": {...}, "cwd": "..."}``, that carries three
descriptors: the kernel's stdout and stderr, and the kernel's own channel back to the test process. On
that channel the kernel says its process id once it leads a session of its own (the test process reads
the kernel's process group from then on), and the template says ``exit N`` when the kernel has ended.
The template ends when the test process closes its end.

A forked kernel is what ``python -m ipykernel_launcher`` would have started, as far as the tests can tell:
a session leader with the environment, working folder, ``sys.path`` and standard streams it was given,
no descriptor of the template's, and the signal dispositions of a new Python process.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import selectors
import socket
import sys
import tempfile
import traceback

LAUNCHER = "ipykernel_launcher"


def serve(control: socket.socket) -> None:
    """Fork a kernel for each request, and tell each kernel's channel how it ended, until the test process
    goes."""
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    paths = _own_paths()
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
                if not message:
                    return
                pid, channel = _fork(json.loads(message), fds, paths)
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, channel))
            else:
                pid, channel = key.data
                selector.unregister(key.fileobj)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    channel.send(f"exit {os.waitstatus_to_exitcode(status)}".encode())
                except OSError:
                    pass  # the test process forgot the kernel
                channel.close()


def _own_paths() -> list[str]:
    """The template's ``sys.path`` less what a kernel's start sets for itself: the script's folder and
    ``$PYTHONPATH``'s entries."""
    own = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    return [path for path in sys.path[1:] if path not in own]


def _fork(request: dict, fds: list[int], paths: list[str]) -> tuple[int, socket.socket]:
    stdout, stderr, channel_fd = fds
    channel = socket.socket(fileno=channel_fd)
    pid = os.fork()
    if pid == 0:
        try:
            _become_kernel(request, stdout, stderr, channel, paths)
        finally:
            os._exit(70)  # only if becoming a kernel failed before it ran
    os.close(stdout)
    os.close(stderr)
    return pid, channel


def _become_kernel(request: dict, stdout: int, stderr: int, channel: socket.socket, paths: list[str]) -> None:
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
    keep = channel.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    tempfile.tempdir = None  # $TMPDIR is read again
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    added = list(filter(None, env.get("PYTHONPATH", "").split(os.pathsep)))
    sys.path[:] = [os.getcwd(), *added, *paths]
    cmd = request["cmd"]
    # ipykernel read $JPY_PARENT_PID as the template imported it: the kernel's is given as an option.
    parent = [f"--IPKernelApp.parent_handle={env['JPY_PARENT_PID']}"] if "JPY_PARENT_PID" in env else []
    sys.argv = [LAUNCHER, *cmd[3:], *parent]  # runpy puts the launcher's file first
    sys.stdout.flush()
    channel.send(str(os.getpid()).encode())
    channel.close()
    os._exit(_run_kernel())


def _run_kernel() -> int:
    """What ``python -m ipykernel_launcher`` runs, then what its interpreter does on the way out."""
    code = 0
    try:
        runpy.run_module(LAUNCHER, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    return code


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    import ipykernel.ipkernel  # noqa: F401
    import ipykernel.kernelapp  # noqa: F401
    import IPython  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    control.send(b"ready")
    serve(control)


if __name__ == "__main__":
    main()
