"""The end-to-end tiers' kernels: real Jupyter kernels with the extension loaded, one per module
(``kernel``) or per test (``fresh_kernel``, ``bare_kernel``); after every test, a kernel still alive
holds no child process.

End-to-end tests assert on what a user sees (the cell's stream and error messages, the
namespace) and on what must not remain afterwards (processes, ports, files).

These kernels start their fork server with their first forkserver cell (``TaasMagics.warm_fork_server``
False), not as the extension loads: most never run one, and a warm server costs each kernel about 3 s
of CPU (torch imported once more), a fifth of the tier's time on two cores. A module whose tests are about
the warm server (its start, its state at load, interrupts while it serves) says ``WARM_FORK_SERVER = True``.
"""

from __future__ import annotations

import time

import pytest
from support.kernel import NO_GPU, Kernel


def _warm(request: pytest.FixtureRequest) -> bool:
    """Whether the kernels of the requesting module start their fork server as the extension loads."""
    return bool(getattr(request.module, "WARM_FORK_SERVER", False))


@pytest.fixture(scope="module")
def kernel(request):
    k = Kernel(warm_fork_server=_warm(request))
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def no_gpu_kernel(request):
    """A kernel that sees no CUDA device on any machine: for what taas says and does without one."""
    k = Kernel(NO_GPU, warm_fork_server=_warm(request))
    yield k
    k.shutdown()


@pytest.fixture
def fresh_kernel(request):
    k = Kernel(warm_fork_server=_warm(request))
    yield k
    k.shutdown()


@pytest.fixture
def bare_kernel(request):
    """A kernel that has loaded the extension and imported neither torch nor Ray: what taas imports
    for the user, in its first cell or its first connection to a cluster, is still to come."""
    k = Kernel(imports="import sys", warm_fork_server=_warm(request))
    yield k
    k.shutdown()


@pytest.fixture(autouse=True)
def _no_leftover_children(request):
    """After every test that used a kernel still alive, that kernel has no child processes left."""
    yield
    for k in request.node.funcargs.values():
        if isinstance(k, Kernel) and k.manager.is_alive():
            deadline = time.monotonic() + 5
            while k.children() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not k.children(), f"left behind: {[p.cmdline() for p in k.children()]}"
