"""How a parallel run of the end-to-end tiers (``pytest -n N --dist loadfile``, pytest-xdist) shares the
tests among its workers.

Each module's tests go to one worker, in order: they share the module's kernel, and some of them the
session it keeps. The cluster tier's modules go to one worker together: they hand one Ray cluster on
from module to module, and two Ray clusters must never start on this machine at once. The largest
share, the cluster tier, is handed out first. Other ``--dist`` modes are xdist's own (the unit and
integration tiers run test by test).
"""

from __future__ import annotations

import pytest
from hypothesis import settings

# No deadline for any generated example: an example's wall time on a shared two-core machine says how busy
# the machine is, not whether the code is right (a unit test's 200 ms deadline failed beside the end-to-end
# tiers). The tests whose assertions are about time are the timing tier's, run with nothing beside them.
settings.register_profile("taas", deadline=None)
settings.load_profile("taas")

CLUSTER_TIER = "tests/e2e/cluster/"


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, which test-min's environment lacks
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getoption("dist") != "loadfile":
        return None  # xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return CLUSTER_TIER if module.startswith(CLUSTER_TIER) else module

    return ByModule(config, log)
