"""The tests' forked kernels (support/forked_kernels.py) are what a plain start would have made, as far as
the tests and taas can tell: a session of their own, the environment, folder, path and descriptors they
were given, interrupts and exits as jupyter_client expects them; and none outlives its template."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import forked_kernels
from support.forked_kernels import ForkedKernelManager, forkable
from support.kernel import Kernel

pytestmark = pytest.mark.skipif(
    os.environ.get(forked_kernels.SWITCH) == "0", reason=f"{forked_kernels.SWITCH}=0 starts every kernel plainly"
)

STATE = (
    "(os.getpid(), os.getsid(0), os.getpgid(0), os.getcwd(), sys.path, os.environ.get('TAAS_T_GIVEN'), "
    "'TAAS_T_DROPPED' in os.environ, sys.argv[0].endswith('ipykernel_launcher.py'), "
    "[str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE, signal.SIGTERM)])"
)


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


@pytest.fixture
def pair(tmp_path, monkeypatch):
    """A forked kernel and a plain one, started alike, in ``tmp_path``, with a variable of this process's
    that the forked kernel's environment leaves out."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TAAS_T_DROPPED", "1")
    env = {"TAAS_T_GIVEN": "given", "TAAS_T_DROPPED": None, "PYTHONPATH": str(tmp_path / "shared")}
    forked = Kernel(env, imports="import torch, os, sys, signal, time", warm_fork_server=False)
    monkeypatch.setenv(forked_kernels.SWITCH, "0")
    plain = Kernel(env, imports="import torch, os, sys, signal, time", warm_fork_server=False)
    yield forked, plain
    forked.shutdown()
    plain.shutdown()


def test_a_forked_kernel_is_what_a_plain_start_makes(pair, tmp_path):
    forked, plain = pair
    assert isinstance(forked.manager, ForkedKernelManager) and not isinstance(plain.manager, ForkedKernelManager)
    pid, session, group, folder, path, given, dropped, launcher, _ = forked.value(STATE)
    assert pid == forked.pid == session == group, "it leads a session and a process group of its own"
    assert (folder, path[0], given, dropped, launcher) == (
        str(tmp_path),
        str(tmp_path / "shared"),
        "given",
        False,
        True,
    )
    assert forked.value(STATE)[3:] == plain.value(STATE)[3:], "the same folder, path, variables and handlers"
    template = psutil.Process(forked.pid).parent()
    assert template is not None and not _socket_inodes(forked.pid) & _socket_inodes(template.pid), (
        "no descriptor of the template's"
    )


def test_a_forked_kernel_is_interrupted_restarted_and_ends_as_a_plain_one(pair):
    forked, _ = pair
    r = forked.execute("time.sleep(60)", interrupt_after=1.0)
    assert r.error is not None and r.error["ename"] == "KeyboardInterrupt"
    first = forked.pid
    forked.manager.restart_kernel(now=True)
    forked.client.wait_for_ready(timeout=60)
    forked.pid = forked.manager.provisioner.process.pid
    assert forked.pid != first and not psutil.pid_exists(first), "the old one ended, and the template reaped it"
    assert forked.execute("print('again')").ok().stdout == "again\n"
    process = forked.manager.provisioner.process
    os.kill(forked.pid, signal.SIGKILL)
    assert process.wait(timeout=10) == -signal.SIGKILL, "the template reaps it and says how it ended"
    assert not psutil.pid_exists(forked.pid)


def test_no_forked_kernel_outlives_its_template():
    kernel = Kernel(warm_fork_server=False)
    try:
        template = forked_kernels.template()
        assert psutil.Process(kernel.pid).ppid() == template.process.pid
        template.process.kill()
        template.process.wait()
        deadline = time.monotonic() + 10
        while psutil.pid_exists(kernel.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(kernel.pid), "ipykernel's parent poller ends it within a second"
        assert kernel.manager.provisioner.process.poll() == -signal.SIGKILL
    finally:
        kernel.shutdown()
    again = Kernel(warm_fork_server=False)
    try:
        assert isinstance(again.manager, ForkedKernelManager) and again.value("1 + 1") == 2, "a new template starts"
    finally:
        again.shutdown()


NAMES = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZ_"), min_size=1, max_size=12)


@given(names=st.lists(NAMES, max_size=4), imports=st.sampled_from(["import torch", "import sys", ""]))
def test_only_a_kernel_that_imports_torch_given_variables_read_later_is_forked(names, imports):
    later = all(name.startswith(forked_kernels.READ_LATER) for name in names)
    assert forkable(imports, dict.fromkeys(names, "1")) == ("torch" in imports and later)
    assert not forkable(imports, {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": None})
