"""Autoreload for a session's ranks, without processes: what the kernel sends, what a rank reloads."""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

import pytest
from IPython.extensions.autoreload import AutoreloadMagics

from taas_magic.kernel.sessions.reloading import KernelReloads, describe, mode
from taas_magic.rank.reloading import RankReloads
from taas_magic.wire.rank_control import Reload


def write_module(folder: Path, name: str, value: int) -> None:
    """Each version at a later time, by whole seconds: cached bytecode and autoreload go by it."""
    path = folder / f"{name}.py"
    path.write_text(f"def f():\n    return {value}\n\nclass Box:\n    def get(self):\n        return {value}\n")
    os.utime(path, (1_700_000_000 + 10 * value,) * 2)


@pytest.fixture
def module_folder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [name for name in sys.modules if name.startswith("reloading_test_")]:
        del sys.modules[name]


def shell_with(magics: AutoreloadMagics | None) -> types.SimpleNamespace:
    """What the kernel's shell shows of its extensions: the autoreload magics once loaded."""
    registry = {"AutoreloadMagics": magics} if magics is not None else {}
    return types.SimpleNamespace(magics_manager=types.SimpleNamespace(registry=registry))


def test_without_the_extension_or_with_it_off_the_ranks_keep_their_modules():
    assert KernelReloads(shell_with(None)).for_cell(shell_with(None), [0, 1]) is None
    assert describe(shell_with(None)) == "kept as the session's ranks imported them (autoreload is off)"
    shell = shell_with(AutoreloadMagics(shell=None))
    assert KernelReloads(shell).for_cell(shell, [0, 1]) is None and mode(shell) == "autoreload is off"


@pytest.mark.parametrize(
    "spelling, every, new_objects, said",
    [
        ("2", True, False, "%autoreload 2 is on"),
        ("all", True, False, "%autoreload 2 is on"),
        ("3", True, True, "%autoreload 3 is on"),
        ("explicit", False, False, "%autoreload 1 is on: the modules named with %aimport"),
    ],
)
def test_the_kernel_sends_its_autoreload_mode_with_each_cell(spelling, every, new_objects, said):
    magics = AutoreloadMagics(shell=None)
    magics._reloader.mark_module_reloadable("chosen")  # %aimport chosen
    magics._reloader.mark_module_skipped("left")  # %aimport -left
    magics.autoreload(spelling)
    shell = shell_with(magics)
    assert KernelReloads(shell).for_cell(shell, [0, 1]) == Reload(every, ("chosen",), ("left",), new_objects)
    assert describe(shell) == f"reloaded in the session's ranks before each cell when changed ({said})"


def test_what_autoreload_now_reloaded_in_the_kernel_goes_to_the_ranks_once(module_folder):
    write_module(module_folder, "reloading_test_now", 1)
    importlib.import_module("reloading_test_now")
    magics = AutoreloadMagics(shell=None)  # notes the module's time, as when the extension loads
    shell = shell_with(magics)
    reloads = KernelReloads(shell)
    write_module(module_folder, "reloading_test_now", 2)
    magics.autoreload("now")
    assert sys.modules["reloading_test_now"].f() == 2
    assert reloads.for_cell(shell, [0]) == Reload(False, ("reloading_test_now",)), "--ranks 0"
    assert reloads.for_cell(shell, [0, 1]) == Reload(False, ("reloading_test_now",)), "rank 1's first cell since"
    assert reloads.for_cell(shell, [0, 1]) is None, "reloaded once: the next cell keeps it"


def test_a_rank_reloads_the_modules_it_is_told_and_what_it_holds_gets_the_new_code(module_folder):
    write_module(module_folder, "reloading_test_held", 1)
    module = importlib.import_module("reloading_test_held")
    held, box = module.f, module.Box()
    reloads = RankReloads({})
    write_module(module_folder, "reloading_test_held", 2)
    reloads.before_cell(None)
    reloads.before_cell(Reload(False, ("reloading_test_other",)))
    assert (module.f(), held(), box.get()) == (1, 1, 1), "not told to reload it: kept"
    reloads.before_cell(Reload(False, ("reloading_test_held",)))
    assert (module.f(), held(), box.get()) == (2, 2, 2)


def test_a_module_a_cell_imported_is_measured_from_when_it_was_imported(module_folder):
    reloads = RankReloads({})
    write_module(module_folder, "reloading_test_late", 1)
    module = importlib.import_module("reloading_test_late")  # in a cell
    reloads.after_cell()
    write_module(module_folder, "reloading_test_late", 2)
    reloads.before_cell(Reload(False, ("reloading_test_late",)))
    assert module.f() == 2


def test_autoreload_loaded_again_is_no_reload_of_what_it_notes_afresh(module_folder):
    write_module(module_folder, "reloading_test_again", 1)
    importlib.import_module("reloading_test_again")
    shell = shell_with(AutoreloadMagics(shell=None))
    reloads = KernelReloads(shell)
    write_module(module_folder, "reloading_test_again", 2)
    shell.magics_manager.registry["AutoreloadMagics"] = AutoreloadMagics(shell=None)  # %reload_ext autoreload
    assert reloads.for_cell(shell, [0, 1]) is None, "the kernel did not reload it: neither do the ranks"


def test_a_module_that_fails_to_reload_says_so_and_stays_as_it_was(module_folder, capsys):
    write_module(module_folder, "reloading_test_broken", 1)
    module = importlib.import_module("reloading_test_broken")
    reloads = RankReloads({})
    path = module_folder / "reloading_test_broken.py"
    path.write_text("def f(:\n")
    os.utime(path, (1_700_000_100,) * 2)
    reloads.before_cell(Reload(False, ("reloading_test_broken",)))
    assert module.f() == 1
    assert "[autoreload of reloading_test_broken failed:" in capsys.readouterr().err
