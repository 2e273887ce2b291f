"""Which registered loaders a cell or a session is served, and the line said when data options serve none."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

import taas
from taas_magic.configurations import load_catalog
from taas_magic.kernel.header import options, spec
from taas_magic.kernel.magics import TaasMagics
from taas_magic.kernel.running import delivery_planning
from taas_magic.process.machine import Machine


def build(line: str) -> spec.LaunchSpec:
    return spec.build(options.parse(TaasMagics.taas, line), load_catalog({}), Machine(cpus=8, cuda_devices=2), {})


@pytest.fixture
def notebook() -> dict:
    loader = DataLoader(list(range(8)), batch_size=2)
    taas.register(loader)
    return {"train": loader, "plain": DataLoader(list(range(4))), "n": 3, "_hidden": loader}


def test_a_cell_is_served_the_registered_loaders_it_reads(notebook, capsys):
    (plan,) = delivery_planning.for_cell(build("--gpus 2 --cpus 2"), {"train", "n"}, notebook)
    assert (plan.name, plan.producers) == ("train", 2)
    assert delivery_planning.for_cell(build("--gpus 2 --cpus 0"), {"train"}, notebook) == ()  # delivery off
    assert capsys.readouterr().err == ""


def test_a_session_is_served_every_registered_loader_the_notebook_names(notebook, capsys):
    (plan,) = delivery_planning.for_session(build("--gpus 2 --keep"), notebook)
    assert plan.name == "train" and plan.on_demand, "served to whichever cell iterates it"
    assert capsys.readouterr().err == ""


@given(
    line=st.sampled_from(["--cpus 2", "--units 64", "--order fastest", "--prefetch 4"]), value=st.none() | st.integers()
)
def test_data_options_that_serve_no_loader_say_so_in_one_line(line, value):
    """A name bound to anything but a registered loader (None the commonest) is served nothing."""
    cell, session = build(f"--gpus 2 {line}"), build(f"--gpus 2 --keep {line}")
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        assert delivery_planning.for_cell(cell, {"x"}, {"x": value}) == ()
        assert delivery_planning.for_session(session, {"x": value, "plain": DataLoader([1])}) == ()
    assert said.getvalue().splitlines() == [
        "taas: --cpus/--units/--order/--prefetch have no effect: the cell uses no registered DataLoader "
        "(taas.register(loader) in an earlier cell)",
        "taas: --cpus/--units/--order/--prefetch have no effect: the notebook has no registered DataLoader "
        "(taas.register(loader) before the cell that starts the session)",
    ]
