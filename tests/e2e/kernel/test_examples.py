"""The example notebooks, executed headless as a user would run them (CPU, 2 ranks, small data)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.notebooks import accuracy, execute, mnist


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return mnist(tmp_path_factory.mktemp("mnist"))


def test_mnist_notebook(data, tmp_path, monkeypatch):
    text = execute("mnist.ipynb", data, tmp_path, monkeypatch)
    assert accuracy(text) > 80
    assert text.count("Test accuracy") == 1, "only rank 0 reports"


def test_lightning_notebook_trains_and_returns_the_model(data, tmp_path, monkeypatch):
    text = execute("mnist_lightning.ipynb", data, tmp_path, monkeypatch)
    assert accuracy(text) > 40, "one short epoch learns well beyond chance (10%)"
    kernel_score = float(re.search(r"the returned model scores ([\d.]+)%", text)[1])
    assert abs(kernel_score - accuracy(text)) < 0.5, "the model that came back is the one rank 0 trained"


def test_data_delivery_notebook(data, tmp_path, monkeypatch):
    text = execute("mnist_data_delivery.ipynb", data, tmp_path, monkeypatch)
    assert accuracy(text) > 80
    assert re.search(r"taas: train_loader: 32 elements delivered to 2 ranks", text), text[-2000:]
    assert (tmp_path / "mnist_cnn_delivery.pt").exists()


def test_session_notebook_trains_in_the_same_ranks_from_cell_to_cell(tmp_path, monkeypatch):
    text = execute("session.ipynb", tmp_path, tmp_path, monkeypatch)
    pids = dict(re.findall(r"\[rank (\d)\] rank \d of 2 ready, pid (\d+)", text))
    assert sorted(pids) == ["0", "1"], text[-2000:]
    assert re.search(rf"\[rank 0\] DistributedDataParallel in rank 0, pid {pids['0']}, 30 steps", text), (
        "--ranks 0 runs in the process that started the session, where the DDP model still is"
    )
    after_30 = float(re.search(r"30 steps: loss on the whole data set ([\d.]+)", text)[1])
    assert re.search(r"\[rank 0\] after 30 steps: loss [\d.]+", text), text[-2000:]
    assert re.search(r"\[rank 0\] after 60 steps at lr 0.02: loss [\d.]+", text), "the changed LR reached the ranks"
    assert "[rank 0] every rank holds the same weights: True" in text
    in_rank0 = re.search(r"\[rank 0\] rank 0 after 60 steps: loss on the whole data set ([\d.]+)", text)[1]
    assert re.search(r"in the notebook: loss on the whole data set ([\d.]+)", text)[1] == in_rank0
    untrained = float(re.search(r"untrained model from the first cell: ([\d.]+)", text)[1])
    assert float(in_rank0) < after_30 < untrained / 10, "training went on from cell to cell"
    assert re.search(r"session: +up: 2 ranks on cpu, started by fork, 6 cells run", text), text[-2000:]
    assert "taas: session stopped; its 2 ranks are gone" in text
