"""What every tier shares: a temporary folder per test process, and how a parallel run
(``pytest -n N --dist loadfile``, pytest-xdist) shares the tests among its workers.

Each worker (and a run without xdist) has a temporary folder of its own, in ``$TMPDIR`` for all it
starts (kernels, ranks, a Ray cluster and its agents): what one worker's tests look for there, or find
by it in a process's environment (``support.cluster.ours``), is never another's. It is removed at the end.

Each module's tests go to one worker, in order: they share the module's kernel, and some of them the
session it keeps. A cluster module that hands its Ray cluster on to the next (``CLUSTER_SCOPES``) goes
with it; each worker starts a cluster of its own, on loopback addresses of its own. The cluster
modules, the longest shares, are handed out first, then the modules that mostly wait, each with one that
computes. Other ``--dist`` modes are xdist's own (the unit and integration tiers run test by test).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from itertools import zip_longest

import pytest
from hypothesis import settings

# No deadline for any generated example: an example's wall time on a shared two-core machine says how busy
# the machine is, not whether the code is right (a unit test's 200 ms deadline failed beside the end-to-end
# tiers). The tests whose assertions are about time are the timing tier's, run with nothing beside them.
settings.register_profile("taas", deadline=None)
settings.load_profile("taas")

CLUSTER_TIER = "tests/e2e/cluster/"
# Modules that run in the same worker as the one named, one after the other: test_cluster_files.py shares its
# Ray cluster; the example notebook, which starts a cluster of its own, follows once that one stopped. The
# tier's two workers then take about the same time (about 400 s each here): test_cluster_nodes.py, whose
# nodes come and go, alone in the other.
CLUSTER_SCOPES = {
    f"{CLUSTER_TIER}test_cluster_files.py": f"{CLUSTER_TIER}test_cluster.py",
    f"{CLUSTER_TIER}test_examples_cluster.py": f"{CLUSTER_TIER}test_cluster.py",
}

_own_temporary_folder: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _own_temporary_folder
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    # Beside the others, not inside xdist's controller's folder: Ray's socket paths must stay short.
    machines = os.environ.setdefault("TAAS_TESTS_TMPDIR", tempfile.gettempdir())
    _own_temporary_folder = tempfile.mkdtemp(prefix=f"taas-t-{worker}-", dir=machines)
    os.chmod(_own_temporary_folder, 0o1777)  # as /tmp is: tests that run a step as another user write here too
    os.environ["TMPDIR"] = _own_temporary_folder
    tempfile.tempdir = None  # read $TMPDIR again


def pytest_unconfigure(config: pytest.Config) -> None:
    if _own_temporary_folder is not None:
        shutil.rmtree(_own_temporary_folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The cluster tier first (its modules are the longest); then the modules that mostly wait, each followed
    by one that computes, then the rest; every module's tests in their own order.

    A module says ``MOSTLY_WAITS = True`` when its tests spend most of their time waiting (for a timeout, a
    hang to be seen, a debugger): beside a module that keeps the cores busy, its waits cost no time. Left to
    the end, as alphabetical order left them, they ran side by side with the cores almost idle.
    """
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    cluster, waiting, computing = [], [], []
    for name, tests in modules.items():
        if name.startswith(CLUSTER_TIER):
            cluster.append(tests)
        elif getattr(getattr(tests[0], "module", None), "MOSTLY_WAITS", False):
            waiting.append(tests)
        else:
            computing.append(tests)
    paired = [tests for pair in zip_longest(waiting, computing[: len(waiting)]) for tests in pair if tests]
    items[:] = [item for tests in [*cluster, *paired, *computing[len(waiting) :]] for item in tests]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, which test-min's environment lacks
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getoption("dist") != "loadfile":
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # in the order of collection: the cluster tier first

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return CLUSTER_SCOPES.get(module, module)

    return ByModule(config, log)
