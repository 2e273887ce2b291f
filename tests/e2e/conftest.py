"""The end-to-end tiers' kernels: real Jupyter kernels with the extension loaded, one per module
(``kernel``) or per test (``fresh_kernel``, ``bare_kernel``); after every test, a kernel still alive
holds no child process.

End-to-end tests assert on what a user sees (the cell's stream and error messages, the
namespace) and on what must not remain afterwards (processes, ports, files).
"""

from __future__ import annotations

import time

import pytest
from support.kernel import NO_GPU, Kernel


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def no_gpu_kernel():
    """A kernel that sees no CUDA device on any machine: for what taas says and does without one."""
    k = Kernel(NO_GPU)
    yield k
    k.shutdown()


@pytest.fixture
def fresh_kernel():
    k = Kernel()
    yield k
    k.shutdown()


@pytest.fixture
def bare_kernel():
    """A kernel that has loaded the extension and imported neither torch nor Ray: what taas imports
    for the user, in its first cell or its first connection to a cluster, is still to come."""
    k = Kernel(imports="import sys")
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
