"""The cluster example notebook, executed headless as a user would run it: it starts a Ray cluster of its
own on this machine, so it is in the cluster tier, in test_cluster.py's worker once that module's cluster has
stopped (tests/conftest.py's CLUSTER_SCOPES)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.notebooks import accuracy, execute, mnist


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return mnist(tmp_path_factory.mktemp("mnist"))


@pytest.mark.timeout(400)  # a cluster of its own and a training epoch, on a machine busy with other tests
def test_cluster_notebook_trains_across_two_nodes_and_brings_the_weights_back(data, tmp_path, monkeypatch, peers):
    pytest.importorskip("ray")
    text = execute("mnist_cluster.ipynb", data, tmp_path, monkeypatch)
    # 80.0-83% here: gloo's all-reduce and torch's threads sum gradients in an order that varies between runs.
    # Wrong or missing elements would leave it near 10%.
    assert accuracy(text) > 75, text[-3000:]
    assert sorted(re.findall(r"rank (\d) of 4 on node (\d)", text)) == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")]
    assert "mnist_cnn_cluster.pt" in text and "copied into this notebook's folder" in text
    assert re.search(r"accuracy in the notebook: ([\d.]+)%", text)[1] == f"{accuracy(text):.2f}"
    assert (tmp_path / "mnist_cnn_cluster.pt").exists()
    # One epoch over 2000 images in the batches the loader's own generator fixes: 93.25% in every run here (it
    # was 69-94% while the shuffle followed the kernel's random seed, which failed a CI run). A loader that
    # delivered the wrong elements, or none, would leave it near 10%.
    delivered = float(re.search(r"Test accuracy with batches from the CPU node: ([\d.]+)%", text)[1])
    assert delivered > 80, text[-3000:]
    assert re.search(r"taas: train_loader: \d+ elements delivered to 4 ranks", text), text[-2000:]
    # The notebook's own LocalCluster, its kernel and ranks talked to nobody beyond loopback but the name server
    # (torch's store names its peers with reverse lookups: test_cluster_nodes.py's xfail says why).
    assert not peers.beyond_loopback(), peers.beyond_loopback()
