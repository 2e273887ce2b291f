"""The debugger internals taas uses (ipykernel's Debugger, debugpy's pydevd) are there in the installed
releases; where one is not, each caller goes on as its adapter says."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types

import pytest

from taas_magic.process import ipykernel_private


@pytest.fixture
def debugger():
    """ipykernel's Debugger as a kernel makes it, without a kernel: nothing it is given is used until a client
    attaches."""
    from ipykernel.debugger import Debugger

    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return Debugger(logging.getLogger("test"), None, lambda message: None, None, None, [], True)


def test_every_attribute_of_ipykernels_debugger_taas_uses_is_in_this_ipykernel(debugger):
    import ipykernel

    assert ipykernel_private.missing(debugger) == [], (
        f"ipykernel {ipykernel.__version__} lacks {ipykernel_private.missing(debugger)}: see "
        "taas_magic/process/ipykernel_private.py for what each is used for and what happens without it"
    )
    assert ipykernel_private.attached(debugger) is False and ipykernel_private.stopped_threads(debugger) == set()
    assert ipykernel_private.just_my_code(debugger) is True and ipykernel_private.kept_breakpoints(debugger) == {}


def test_intercepting_the_debugger_hands_back_its_own_answerer_and_release_restores_it(debugger):
    own = debugger.process_request

    async def ours(message):
        return await original(message)

    original = ipykernel_private.intercept(debugger, ours)
    assert original == own and debugger.process_request is ours
    ipykernel_private.release(debugger, ours, original)
    assert debugger.process_request == own


def test_release_leaves_a_later_stand_in_in_place(debugger):
    original = ipykernel_private.intercept(debugger, first := lambda message: message)
    ipykernel_private.intercept(debugger, later := lambda message: message)
    ipykernel_private.release(debugger, first, original)
    assert debugger.process_request is later


def test_a_debugger_without_them_is_read_as_not_attached_with_nothing_stopped_or_hidden():
    bare = types.SimpleNamespace(process_request=None, event_callback=print)
    assert not ipykernel_private.attached(bare) and ipykernel_private.stopped_threads(bare) == set()
    assert ipykernel_private.variable_filter(bare)("anything") and ipykernel_private.just_my_code(bare)
    assert ipykernel_private.kept_breakpoints(bare) == {}
    assert ipykernel_private.missing(bare) == [
        f"Debugger.{name}" for name in ipykernel_private.ATTRIBUTES if name not in ("process_request", "event_callback")
    ]
    assert ipykernel_private.debugger_of(types.SimpleNamespace(kernel=types.SimpleNamespace(debugger=bare))) is bare
    assert ipykernel_private.debugger_of(types.SimpleNamespace()) is None  # a terminal IPython


def test_everything_of_pydevd_taas_uses_is_in_this_debugpy():
    """In a process of its own: importing pydevd sets up more than this test process should keep."""
    script = (
        "import debugpy, json; from taas_magic.process import pydevd_private; "
        "print(json.dumps([debugpy.__version__, pydevd_private.missing()]))"
    )
    env = {**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    done = subprocess.run(
        [sys.executable, "-Xfrozen_modules=off", "-c", script], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    version, absent = json.loads(done.stdout.strip().splitlines()[-1])
    assert absent == [], (
        f"debugpy {version} lacks {absent}: see taas_magic/process/pydevd_private.py for what each is used for"
    )
