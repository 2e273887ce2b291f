"""DataLoader workers in producers and ranks leave no multiprocessing folders behind, however the cell ends."""

from __future__ import annotations

import pytest
from support.kernel import Kernel

SETUP = """
import time, taas, torch
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self):
        return 4000
    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.tensor([i])
workers = DataLoader(torch.arange(64.0).reshape(32, 2), batch_size=4, num_workers=2)
slow = DataLoader(Slow(), batch_size=2, num_workers=2)
taas.register(workers)
taas.register(slow)
"""


@pytest.fixture(scope="module")
def private_tmp(tmp_path_factory):
    """A kernel whose temporary folder (and its ranks', producers' and workers') is the test's own."""
    folder = tmp_path_factory.mktemp("tmp")
    kernel = Kernel({"TMPDIR": str(folder)}, warm_fork_server=False)
    try:
        kernel.execute(SETUP).ok()
        yield kernel, folder
    finally:
        kernel.shutdown()


def left_behind(kernel: Kernel, folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if str(kernel.pid) not in p.name)


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_registered_loaders_with_workers_leave_no_folders(private_tmp, start):
    kernel, folder = private_tmp
    kernel.execute(f"#pragma taas --gpus 2 --start {start}\nn = sum(1 for b in workers)").ok()
    assert left_behind(kernel, folder) == []


def test_workers_a_rank_leaves_running_leave_no_folders(private_tmp):
    kernel, folder = private_tmp
    kernel.execute(
        "#pragma taas --gpus 2 --cpus 0\nbatches = iter(DataLoader(torch.arange(64), batch_size=4, "
        "num_workers=2, persistent_workers=True))\nfirst = next(batches)"
    ).ok()
    assert left_behind(kernel, folder) == []


def test_an_interrupt_or_a_failure_while_workers_run_leaves_no_folders(private_tmp):
    kernel, folder = private_tmp
    result = kernel.execute("#pragma taas --gpus 2\nfor b in slow:\n    pass", interrupt_after=2.5, timeout=30)
    assert "KeyboardInterrupt" in result.traceback
    result = kernel.execute(
        "#pragma taas --gpus 2\nfor i, b in enumerate(slow):\n    if i == 5:\n        raise ValueError('stop here')",
        timeout=30,
    )
    assert "stop here" in result.error["evalue"], "the producers are stopped after the failure"
    assert left_behind(kernel, folder) == []
