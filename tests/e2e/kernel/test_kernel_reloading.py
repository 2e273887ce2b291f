"""A module edited while a session runs: its ranks run the code the notebook runs, in a real kernel.

With IPython's autoreload on, the kernel reloads a changed module before each cell, and so do the
session's ranks, objects they hold included; with it off, the kernel and the ranks both keep what
they imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from support.kernel import Kernel

SOURCE = "def f():\n    return {value}\n\nclass Box:\n    def get(self):\n        return {value}\n"


def write_module(folder: Path, name: str, value: int) -> None:
    """The module's file, at a time that moves forward with each version: Python's cached bytecode
    and autoreload both tell an edit by the file's time, the bytecode to the second."""
    path = folder / f"{name}.py"
    path.write_text(SOURCE.format(value=value))
    when = 1_700_000_000 + 10 * value
    os.utime(path, (when, when))


def start_session(kernel: Kernel, folder: Path, name: str, start: str, autoreload: str) -> None:
    """A notebook that imports ``name`` from ``folder`` with ``autoreload`` (lines of magics), and a
    session whose ranks hold the module, a function from it and an instance of its class."""
    write_module(folder, name, 1)
    kernel.execute(f"sys.path.insert(0, {str(folder)!r})\n{autoreload}\nimport {name}").ok()
    r = kernel.execute(
        f"#pragma taas --gpus 2 --keep --start {start}\n"
        f"held, box = {name}.f, {name}.Box()\nprint('before', {name}.f(), held(), box.get())"
    ).ok()
    assert "[rank 1] before 1 1 1" in r.each_rank(), r.stdout


def after_edit(kernel: Kernel, folder: Path, name: str) -> str:
    """Edit the module, then run a session cell that calls it: what each rank printed."""
    write_module(folder, name, 2)
    r = kernel.execute(f"#pragma taas --return none\nprint('after', {name}.f(), held(), box.get())").ok()
    return r.each_rank()


def leave(kernel: Kernel) -> None:
    """The next test starts with autoreload off (the folders stay on sys.path: the notebook holds
    names from their modules)."""
    kernel.execute("%taas stop").ok()
    kernel.execute("%autoreload off").ok()


def modules_line(kernel: Kernel) -> str:
    return re.search(r"session modules: +(.*)", kernel.execute("%taas").ok().stdout)[1]


@pytest.fixture(scope="module")
def kernel():
    k = Kernel(warm_fork_server=False)
    k.execute("%load_ext autoreload").ok()
    yield k
    k.shutdown()


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_with_autoreload_on_the_ranks_run_the_edited_module_as_the_notebook_does(kernel, tmp_path, start):
    name = f"edited_{start}"
    start_session(kernel, tmp_path, name, start, "%autoreload 2")
    try:
        assert modules_line(kernel) == (
            "reloaded in the session's ranks before each cell when changed (%autoreload 2 is on)"
        )
        shown = after_edit(kernel, tmp_path, name)
        assert kernel.value(f"{name}.f()") == 2, "the notebook runs the new code"
        for rank in (0, 1):
            assert f"[rank {rank}] after 2 2 2" in shown, shown  # the function and the instance held too
    finally:
        leave(kernel)


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_with_autoreload_off_the_ranks_keep_the_module_they_imported_as_the_notebook_does(kernel, tmp_path, start):
    name = f"kept_{start}"
    start_session(kernel, tmp_path, name, start, "%autoreload off")
    try:
        assert modules_line(kernel) == "kept as the session's ranks imported them (autoreload is off)"
        shown = after_edit(kernel, tmp_path, name)
        assert kernel.value(f"{name}.f()") == 1, "the notebook keeps the code it imported"
        for rank in (0, 1):
            assert f"[rank {rank}] after 1 1 1" in shown, shown
    finally:
        leave(kernel)


def test_aimported_modules_alone_are_reloaded_with_autoreload_explicit(kernel, tmp_path):
    write_module(tmp_path, "other", 1)
    start_session(kernel, tmp_path, "named", "fork", "%autoreload explicit\n%aimport named\nimport other")
    try:
        assert modules_line(kernel) == (
            "reloaded in the session's ranks before each cell when changed "
            "(%autoreload 1 is on: the modules named with %aimport)"
        )
        write_module(tmp_path, "other", 2)
        shown = after_edit(kernel, tmp_path, "named")
        assert "[rank 1] after 2 2 2" in shown, shown
        r = kernel.execute("#pragma taas --return none\nprint('other', other.f())").ok()
        assert kernel.value("other.f()") == 1 and "[rank 1] other 1" in r.each_rank(), r.stdout
    finally:
        leave(kernel)


def test_autoreload_now_reloads_in_the_ranks_once_what_it_reloaded_in_the_notebook(kernel, tmp_path):
    start_session(kernel, tmp_path, "once", "forkserver", "%autoreload off")
    try:
        write_module(tmp_path, "once", 2)
        kernel.execute("%autoreload now").ok()
        r = kernel.execute("#pragma taas --return none\nprint('after', once.f(), held(), box.get())").ok()
        assert kernel.value("once.f()") == 2 and "[rank 1] after 2 2 2" in r.each_rank(), r.stdout
        write_module(tmp_path, "once", 3)  # autoreload is still off: neither reloads it
        r = kernel.execute("#pragma taas --return none\nprint('later', once.f())").ok()
        assert kernel.value("once.f()") == 2 and "[rank 1] later 2" in r.each_rank(), r.stdout
    finally:
        leave(kernel)


def test_a_module_only_the_ranks_imported_is_reloaded_with_autoreload_on(kernel, tmp_path):
    write_module(tmp_path, "ranks_only", 1)
    kernel.execute(f"sys.path.insert(0, {str(tmp_path)!r})\n%autoreload 2").ok()
    try:
        kernel.execute(
            "#pragma taas --gpus 2 --keep --start forkserver --return none\n"
            "import ranks_only\nprint('before', ranks_only.f())"
        ).ok()
        assert kernel.value("'ranks_only' in sys.modules") is False
        write_module(tmp_path, "ranks_only", 2)
        r = kernel.execute("#pragma taas --return none\nprint('after', ranks_only.f())").ok()
        assert "[rank 0] after 2" in r.each_rank() and "[rank 1] after 2" in r.each_rank(), r.stdout
    finally:
        leave(kernel)
