"""Where a run's time went, as the cell's summary says it: each rank's shares (computing, collectives, data,
setup) and the rank the others waited for, in every kind of cell."""

from __future__ import annotations

import glob
import gzip
import json
import os
import tempfile

import pytest
from support.kernel import ranks_in, view_notes, working_in

MOSTLY_WAITS = True  # for ranks that sleep between collectives (tests/conftest.py)

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
    """Each rank's shares as the summary says them, and the lines under its rows."""
    notes = view_notes(result.displays[-1]["text/plain"])
    shares = {}
    for line in notes:
        if not line.startswith("the others"):
            who, _, text = line.partition(": ")
            shares.update({rank: text for rank in ranks_in(who.split(" ", 1)[1])})
    return shares, notes


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_the_rank_that_sleeps_before_each_all_reduce_is_the_one_the_others_waited_for(kernel, start):
    result = kernel.execute(loop(f"#pragma taas --gpus 2 --start {start}", "dist.get_rank() == 1"), timeout=90).ok()
    rows, notes = summary(result)
    assert notes and notes[-1].startswith("the others waited for rank 1: "), result.displays[-1]["text/plain"]
    assert notes[-1].endswith("of their time in all_reduce"), notes
    waited = int(notes[-1].split(": ")[1].split("%")[0])
    assert waited >= 50, notes
    assert rows[0].startswith("all_reduce") and rows[1].startswith("computing"), rows


def test_a_balanced_loop_names_nobody(kernel):
    result = kernel.execute(loop("#pragma taas --gpus 2", "True"), timeout=90).ok()
    rows, notes = summary(result)
    assert not [note for note in notes if "waited for" in note], result.displays[-1]["text/plain"]
    assert sorted(rows) == [0, 1] and all("computing" in row for row in rows.values()), rows


def test_a_slow_registered_loader_shows_as_data(kernel):
    kernel.execute(
        "import time, taas\nfrom torch.utils.data import DataLoader, Dataset\n"
        "class Slow(Dataset):\n    def __len__(self):\n        return 24\n"
        "    def __getitem__(self, i):\n        time.sleep(0.5)\n        return i\n"
        "slow = DataLoader(Slow(), batch_size=1)\ntaas.register(slow)\n"
    ).ok()
    result = kernel.execute("#pragma taas --gpus 2 --cpus 1\nfor batch in slow:\n    pass\n", timeout=120).ok()
    rows, _ = summary(result)
    assert sorted(rows) == [0, 1] and all("data " in row for row in rows.values()), rows
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


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_profile_leaves_one_merged_trace_of_both_ranks_and_shows_the_picture(kernel, start, tmp_path):
    with working_in(kernel, tmp_path):
        cell = loop(f"#pragma taas --gpus 2 --start {start} --profile", "dist.get_rank() == 1")
        result = kernel.execute(cell, timeout=120).ok()
        status = kernel.execute("%taas").ok().stdout
    (trace,) = tmp_path.glob("taas-profile-*.json.gz")
    size = trace.stat().st_size / 1e6
    assert f"--profile traces:    1 trace, {size:.1f} MB, in this folder (taas-profile-*.json.gz)\n" in status
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(rows.values()) == ["rank 0", "rank 1"], rows
    for pid in rows:
        reduces = [e for e in events if e["pid"] == pid and e.get("name") == "gloo:all_reduce"]
        assert len(reduces) >= ITERATIONS, (rows[pid], len(reduces))
    assert f"taas: --profile: the ranks' trace is {trace} (" in result.stderr, result.stderr
    noise = [line for line in result.stderr.splitlines() if "profil" in line.lower() and "taas: --profile" not in line]
    assert not noise, noise
    (picture,) = [display for display in result.displays if "image/svg+xml" in display]
    assert picture["text/plain"].splitlines()[-1].startswith("the others waited for rank 1"), picture["text/plain"]
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "taas-profile-*")), "the ranks' own traces are gone"


def test_a_profiled_run_that_timeout_stops_still_leaves_the_ranks_trace(kernel, tmp_path):
    """--timeout ends the ranks with SIGTERM (SIGKILL 3 s later): each writes its trace first."""
    with working_in(kernel, tmp_path):
        result = kernel.execute(
            # Long enough for the ranks to be in the cell on a busy machine (a CI run's ranks were still starting
            # their profilers 4 s in); few events, so that stopping the profiler is quick there too.
            "#pragma taas --gpus 2 --profile --timeout 10\nimport time, torch\n"
            "while True:\n    torch.ones(1)\n    time.sleep(0.1)\n",
            timeout=120,
        )
    assert result.error is not None and result.error["ename"] == "RunTimedOut", result.error
    (trace,) = tmp_path.glob("taas-profile-*.json.gz")
    # Where a rank was when --timeout stopped it is in the error's message, what came of its trace in stderr.
    assert process_rows(trace) == ["rank 0", "rank 1"], (result.error["evalue"], result.stderr)
    assert "no rank wrote its trace" not in result.stderr
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "taas-profile-*")), "the ranks' own traces are gone"


def test_without_profile_no_trace_and_no_picture(kernel, tmp_path):
    with working_in(kernel, tmp_path):
        result = kernel.execute(loop("#pragma taas --gpus 2", "False"), timeout=90).ok()
    assert list(tmp_path.iterdir()) == [] and not [d for d in result.displays if "image/svg+xml" in d]


def test_a_session_profiles_the_cells_that_ask_for_it_each_in_a_trace_of_its_own(kernel, tmp_path):
    """--profile on the cell that starts a session profiles that cell; a later cell without it is not
    profiled; a later cell with it gets a trace of its own and the picture; with --ranks, only those ranks."""
    with working_in(kernel, tmp_path):
        try:
            kernel.execute(loop("#pragma taas --gpus 2 --keep --return none --profile", "False")).ok()
            (first,) = tmp_path.glob("taas-profile-*.json.gz")
            assert process_rows(first) == ["rank 0", "rank 1"]
            kernel.execute(loop("#pragma taas", "False")).ok()
            assert list(tmp_path.glob("taas-profile-*.json.gz")) == [first], "a cell without --profile is not profiled"
            later = kernel.execute(loop("#pragma taas --profile", "dist.get_rank() == 1"), timeout=120).ok()
            (second,) = set(tmp_path.glob("taas-profile-*.json.gz")) - {first}
            assert process_rows(second) == ["rank 0", "rank 1"]
            assert f"taas: --profile: the ranks' trace is {second} (" in later.stderr, later.stderr
            (picture,) = [display for display in later.displays if "image/svg+xml" in display]
            assert picture["text/plain"].splitlines()[-1].startswith("the others waited for rank 1")
            kernel.execute("#pragma taas --ranks 1 --profile\nimport torch\nx = torch.ones(100) @ torch.ones(100)").ok()
            (third,) = set(tmp_path.glob("taas-profile-*.json.gz")) - {first, second}
            assert process_rows(third) == ["rank 1"]
        finally:
            kernel.execute("%taas stop").ok()
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "taas-profile-*")), "the ranks' own traces are gone"


def process_rows(trace) -> list[str]:
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sorted(e["args"]["name"] for e in events if e.get("name") == "process_name")
