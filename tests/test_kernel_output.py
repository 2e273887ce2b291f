"""Ranks' output in a real kernel: however much a cell prints, the kernel keeps none of it."""

from __future__ import annotations

import psutil
import pytest

pytestmark = pytest.mark.kernel

PRINT_20_MB = """#pragma taas --gpus 2 --output rank0
line = "x" * 99
for i in range(200_000):
    print(line)
"""


def test_cells_that_print_megabytes_do_not_grow_the_kernel(kernel):
    process = psutil.Process(kernel.pid)
    assert len(kernel.execute(PRINT_20_MB).ok().stdout) == 20_000_000, "every line reaches the cell"
    before = process.memory_info().rss
    for _ in range(3):
        kernel.execute(PRINT_20_MB).ok()
    grown = (process.memory_info().rss - before) / 2**20
    assert grown < 10, f"the kernel grew by {grown:.0f} MB over 3 cells of 20 MB output"
