"""Where a run's time went, as the cell's summary says it: each rank's shares (computing, collectives, data,
setup) and the rank the others waited for, in every kind of cell."""

from __future__ import annotations

import pytest

ITERATIONS = 30  # of 0.2 s each: a run of about 6 s, some six samples per rank


def loop(header: str, sleeper: str) -> str:
    """A 2-rank loop of all_reduces; ranks for which ``sleeper`` is true sleep 0.2 s before each."""
    return (
        f"{header}\nimport time, torch, torch.distributed as dist\n"
        "if not dist.is_initialized():\n    dist.init_process_group('gloo')\n"
        f"for _ in range({ITERATIONS}):\n    if {sleeper}:\n        time.sleep(0.2)\n"
        "    dist.all_reduce(torch.ones(1))\n"
    )


def summary(result) -> tuple[dict[int, str], list[str]]:
    """Each rank's row of the summary, and the lines under the table."""
    lines = result.displays[-1]["text/plain"].splitlines()
    rows = {int(line.split()[1]): line for line in lines if line.startswith("rank ")}
    return rows, [line for line in lines[1:] if not line.startswith(("rank ", "node ")) and line.strip()]


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_the_rank_that_sleeps_before_each_all_reduce_is_the_one_the_others_waited_for(kernel, start):
    result = kernel.execute(loop(f"#pragma taas --gpus 2 --start {start}", "dist.get_rank() == 1"), timeout=90).ok()
    rows, notes = summary(result)
    assert notes and notes[-1].startswith("the others waited for rank 1: "), result.displays[-1]["text/plain"]
    assert notes[-1].endswith("of their time in all_reduce"), notes
    waited = int(notes[-1].split(": ")[1].split("%")[0])
    assert waited >= 50, notes
    assert "all_reduce" in rows[0] and "computing" in rows[1], rows


def test_a_balanced_loop_names_nobody(kernel):
    result = kernel.execute(loop("#pragma taas --gpus 2", "True"), timeout=90).ok()
    rows, notes = summary(result)
    assert not [note for note in notes if "waited for" in note], result.displays[-1]["text/plain"]
    assert all("computing" in row for row in rows.values()), rows


def test_a_slow_registered_loader_shows_as_data(kernel):
    kernel.execute(
        "import time, taas\nfrom torch.utils.data import DataLoader, Dataset\n"
        "class Slow(Dataset):\n    def __len__(self):\n        return 24\n"
        "    def __getitem__(self, i):\n        time.sleep(0.5)\n        return i\n"
        "slow = DataLoader(Slow(), batch_size=1)\ntaas.register(slow)\n"
    ).ok()
    result = kernel.execute("#pragma taas --gpus 2 --cpus 1\nfor batch in slow:\n    pass\n", timeout=120).ok()
    rows, _ = summary(result)
    assert all(" data " in row or row.endswith(" data") or "· data" in row for row in rows.values()), rows
    assert all(row.split("data ")[1].split("%")[0].isdigit() for row in rows.values()), rows


def test_a_session_cells_summary_covers_that_cell(kernel):
    kernel.execute("#pragma taas --gpus 2 --keep --return none\nimport torch.distributed as dist").ok()
    try:
        first = kernel.execute(loop("#pragma taas", "dist.get_rank() == 1"), timeout=90).ok()
        assert summary(first)[1][-1].startswith("the others waited for rank 1"), first.displays[-1]
        second = kernel.execute(loop("#pragma taas", "dist.get_rank() == 0"), timeout=90).ok()
        assert summary(second)[1][-1].startswith("the others waited for rank 0"), second.displays[-1]
    finally:
        kernel.execute("%taas stop").ok()
