"""Run the MNIST example notebook headless: what `make demo` does.

The demo has to work on a fresh clone with no network and no GPU, so it
keeps everything in `.demo/` under the repository root (ignored by git),
provides MNIST-format data there, executes `examples/mnist.ipynb` in a real
Jupyter kernel, and reports the accuracy the distributed training cell printed.

Settings come from the environment and pass through to the kernel unchanged:
TAAS_DEVICE (`cpu` in `make demo`), TAAS_GPUS (number of ranks) and
TAAS_EPOCHS. TAAS_DATA and TAAS_OUTPUT are set here to point into `.demo/`.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import nbformat
from mnist_data import ensure_mnist, is_synthetic
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "examples" / "mnist.ipynb"
WORK = ROOT / ".demo"
DATA = WORK / "data"
EXECUTED = WORK / "mnist.out.ipynb"
CELL_TIMEOUT_S = 600
ACCURACY = re.compile(r"Test accuracy: \d+(?:\.\d+)?%")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def prepare_data() -> None:
    """Make sure MNIST-format data is under .demo/data and say which kind it is."""
    if ensure_mnist(DATA):
        print(
            f"Wrote a small synthetic MNIST-format data set to {DATA.relative_to(ROOT)} "
            "(the real MNIST cannot be downloaded here)."
        )
    elif is_synthetic(DATA):
        print(f"Using the synthetic MNIST-format data set written earlier in {DATA.relative_to(ROOT)}.")
    else:
        print(f"Using the real MNIST data set found in {DATA.relative_to(ROOT)}.")


def cell_text(cell: nbformat.NotebookNode) -> str:
    """Return everything a code cell printed: streams, plain-text results and errors."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.get("data", {}).get("text/plain", "") + "\n")
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}\n")
    return "".join(parts)


def training_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Return the notebook's distributed cell: the code cell headed by `#!g...`."""
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith("#!g"):
            return cell
    raise LookupError(f"{NOTEBOOK.name} has no cell headed '#!g'")


def execute(nb: nbformat.NotebookNode) -> str | None:
    """Run every cell in a fresh python3 kernel started in .demo/; return an error or None.

    The kernel inherits this process's environment, which is how TAAS_* reach
    the notebook. Whatever happens, the executed notebook is saved for a look.
    """
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(WORK)}}
    )
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        return str(exc)
    finally:
        nbformat.write(nb, EXECUTED)
    return None


def report_failure(nb: nbformat.NotebookNode, error: str) -> None:
    """Print what the failing cell printed, then the error nbclient reported."""
    for cell in nb.cells:
        if any(out.output_type == "error" for out in cell.get("outputs", [])):
            print(f"--- output of the failing cell ---\n{cell_text(cell)}", end="")
    plain = error if sys.stderr.isatty() else ANSI.sub("", error)  # tracebacks come coloured
    print(f"--- error ---\n{plain}", file=sys.stderr)


def main() -> int:
    """Prepare data, run the notebook, print the training output and its accuracy."""
    WORK.mkdir(exist_ok=True)
    os.environ["TAAS_DATA"] = str(DATA)
    os.environ["TAAS_OUTPUT"] = str(WORK)
    prepare_data()

    settings = " ".join(f"{k}={os.environ[k]}" for k in ("TAAS_DEVICE", "TAAS_GPUS", "TAAS_EPOCHS") if k in os.environ)
    print(f"Running {NOTEBOOK.relative_to(ROOT)} {settings} ...".replace("  ", " "), flush=True)
    start = time.time()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    error = execute(nb)
    print(f"Notebook finished in {time.time() - start:.0f} s; executed copy: {EXECUTED.relative_to(ROOT)}")
    if error is not None:
        report_failure(nb, error)
        return 1

    text = cell_text(training_cell(nb))
    print(f"--- output of the training cell ---\n{text}", end="" if text.endswith("\n") else "\n")
    found = ACCURACY.findall(text)
    if not found:
        print("No 'Test accuracy: ...%' line in the training cell's output.", file=sys.stderr)
        return 1
    print(found[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
