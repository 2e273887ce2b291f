"""The example notebooks, executed headless as a user would run them (CPU, 2 ranks, small data), and the
MNIST files they read (written here in the IDX format torchvision reads: nothing is downloaded)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbclient
import nbformat

from support import ROOT

EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

from mnist_data import ensure_mnist  # noqa: E402


def mnist(root: Path) -> Path:
    """A small MNIST under ``root``: 2000 training images, 400 test images."""
    ensure_mnist(root, n_train=2000, n_test=400)
    return root


def execute(name: str, data: Path, output: Path, monkeypatch) -> str:
    for key, value in {
        "TAAS_DEVICE": "cpu",
        "TAAS_GPUS": "2",
        "TAAS_EPOCHS": "1",
        "TAAS_DATA": str(data),
        "TAAS_OUTPUT": str(output),
    }.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(output)}}
    ).execute()
    texts = []
    for cell in notebook.cells:
        for out in cell.get("outputs", []):
            texts.append(out.get("text") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(texts)


def accuracy(text: str) -> float:
    return float(re.search(r"\[rank 0\] Test accuracy: ([\d.]+)%", text)[1])
