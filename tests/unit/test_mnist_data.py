"""The synthetic MNIST set behind the demo: torchvision reads it, and it is learnable.

The demo's accuracy line only means something if the data it trains on is a
real classification task, so besides the file format these tests train a
small model on it and check the accuracy, with a shuffled-label control that
shows the same check does fail on data that cannot be learned.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import ROOT
from torchvision import datasets

sys.path.insert(0, str(ROOT / "examples"))
import mnist_data  # noqa: E402

N_TRAIN, N_TEST = 3000, 500


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One synthetic set shared by the module, so it is rendered only once."""
    path = tmp_path_factory.mktemp("mnist")
    mnist_data.write_mnist(path, n_train=N_TRAIN, n_test=N_TEST, seed=0)
    return path


def load(root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a split through torchvision's own MNIST class, as the notebook does."""
    ds = datasets.MNIST(str(root), train=train, download=False)
    return ds.data, ds.targets


@pytest.mark.parametrize(("train", "n"), [(True, N_TRAIN), (False, N_TEST)])
def test_torchvision_loads_both_splits(root: Path, train: bool, n: int) -> None:
    images, labels = load(root, train)
    assert images.shape == (n, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (n,)
    assert sorted(labels.unique().tolist()) == list(range(10))


def test_images_have_ink_and_background(root: Path) -> None:
    """Digits on a dark background, roughly like MNIST (mean intensity about 0.13)."""
    images = load(root, True)[0].float() / 255
    assert 0.05 < images.mean().item() < 0.25
    assert (images.amax(dim=(1, 2)) > 0.6).all()


def test_files_are_idx_format(root: Path) -> None:
    raw = root / "MNIST" / "raw"
    assert (raw / "train-images-idx3-ubyte").read_bytes()[:16] == bytes.fromhex("00000803") + (
        np.array([N_TRAIN, 28, 28], ">u4").tobytes()
    )
    assert (raw / "t10k-labels-idx1-ubyte").read_bytes()[:8] == bytes.fromhex("00000801") + (
        np.array([N_TEST], ">u4").tobytes()
    )


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    for name in ("a", "b"):
        mnist_data.write_mnist(tmp_path / name, n_train=200, n_test=50, seed=7)
    raw_a, raw_b = tmp_path / "a" / "MNIST" / "raw", tmp_path / "b" / "MNIST" / "raw"
    for train in (True, False):
        for name in mnist_data.FILES[train]:
            assert (raw_a / name).read_bytes() == (raw_b / name).read_bytes()
    other, _ = mnist_data.make_digits(200, seed=8)
    assert not np.array_equal(other, load(tmp_path / "a", True)[0].numpy())


def test_train_and_test_differ(root: Path) -> None:
    assert not torch.equal(load(root, True)[0][:N_TEST], load(root, False)[0])


def test_ensure_mnist_writes_once(tmp_path: Path) -> None:
    assert mnist_data.ensure_mnist(tmp_path, n_train=100, n_test=20) is True
    assert mnist_data.is_synthetic(tmp_path)
    before = (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").stat().st_mtime_ns
    assert mnist_data.ensure_mnist(tmp_path, n_train=100, n_test=20) is False
    assert (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").stat().st_mtime_ns == before


def test_ensure_mnist_leaves_other_sets_alone(tmp_path: Path) -> None:
    """A set without the synthetic marker (e.g. the real MNIST) is kept as it is."""
    mnist_data.write_mnist(tmp_path, n_train=100, n_test=20, seed=1)
    (tmp_path / "MNIST" / "raw" / mnist_data.MARKER).unlink()
    assert mnist_data.ensure_mnist(tmp_path) is False
    assert not mnist_data.is_synthetic(tmp_path)
    assert len(load(tmp_path, True)[1]) == 100


def test_ensure_mnist_replaces_incomplete_folder(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"")
    assert mnist_data.ensure_mnist(tmp_path, n_train=100, n_test=20) is True
    assert len(load(tmp_path, False)[1]) == 20


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mnist_data.main([str(tmp_path), "--train", "50", "--test", "30"]) == 0
    assert len(load(tmp_path, True)[1]) == 50 and len(load(tmp_path, False)[1]) == 30
    assert mnist_data.main([str(tmp_path)]) == 0
    assert "already present" in capsys.readouterr().out


def normalize(images: torch.Tensor) -> torch.Tensor:
    """Flatten and standardize with MNIST's mean and std, as the notebook does."""
    return (images.float().flatten(1) / 255 - 0.1307) / 0.3081


def mlp_accuracy(root: Path, shuffle_labels: bool = False, steps: int = 300) -> float:
    """Train a small MLP with Adam on the training split; return test accuracy in percent."""
    torch.manual_seed(0)
    (x_train, y_train), (x_test, y_test) = load(root, True), load(root, False)
    x_train, x_test = normalize(x_train), normalize(x_test)
    if shuffle_labels:
        y_train = y_train[torch.randperm(len(y_train))]
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        batch = torch.randint(len(x_train), (64,))
        loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item() * 100


def test_digits_are_learnable(root: Path) -> None:
    assert mlp_accuracy(root) > 80.0


def test_learnability_check_fails_on_unlearnable_labels(root: Path) -> None:
    """Control: with the labels shuffled the same check stays near chance (10%)."""
    assert mlp_accuracy(root, shuffle_labels=True) < 30.0
