"""The live view's model: what each row says as records, bars and exits arrive, and the summary it becomes."""

from __future__ import annotations

import re

from taas_magic.kernel.view.live_view import RunView
from taas_magic.wire.records import (
    CellEnded,
    Collective,
    DeliveryProgress,
    Failed,
    RankActivity,
    RankProgress,
    RankVitals,
)

MB = 1_000_000


def rows(bundle: dict[str, str]) -> list[list[str]]:
    """The text rows after the caption, split into their columns."""
    return [re.split(r" {2,}", line, maxsplit=3) for line in bundle["text/plain"].splitlines()[1:]]


def test_rows_go_from_starting_to_how_each_rank_ended():
    view = RunView("4 ranks on cpu", range(4))
    assert [row[1] for row in rows(view.render(0.1))] == ["starting"] * 4
    for rank in range(4):
        view.take(rank, RankVitals(1.0, 300 * MB, 310 * MB))
    view.take(0, CellEnded(2.0))
    view.take(1, Failed(2.0, "ValueError", "boom"))
    view.take(2, Failed(2.1, "KeyboardInterrupt", "", interrupted=True))
    view.ended(3, "stopped")
    view.ended(0, "failed")  # its record said how its cell ended: the exit does not change that
    assert [row[1] for row in rows(view.render(3.0))] == ["done", "failed", "stopped", "stopped"]


def test_a_row_shows_memory_the_bar_and_taas_progress():
    view = RunView("1 rank on cuda", [0])
    view.take(0, RankVitals(1.0, 312 * MB, 312 * MB, gpu_memory=12_100 * MB, gpu_utilization=87))
    view.bar(0, "45%|####5     | 45/100 [00:01<00:01, 40.12it/s]")
    view.take(0, RankProgress(1.0, 40, {"loss": 0.5}))
    view.take(0, RankProgress(2.0, 60, {"loss": 0.25}))
    assert rows(view.render(2.0)) == [
        [
            "rank 0",
            "running",
            "312 MB · GPU 12.1 GB 87%",
            "step 60, 20.0 steps/s, loss 0.25 · 45%|####5     | 45/100 [00:01<00:01, 40.12it/s]",
        ]
    ]


def test_a_row_wider_than_the_cell_loses_no_number():
    """A narrow cell once cut ``loss 0.025`` to ``loss 0.0``: the numbers come before the bar, and the row wraps."""
    view = RunView("1 rank on cpu", [0])
    view.take(0, RankVitals(1.0, 300 * MB, 300 * MB))
    view.bar(0, "45%|" + "#" * 200 + "| 45/100 [00:01<00:01, 40.12it/s]")
    view.take(0, RankProgress(1.0, 45, {"loss": 0.025}))
    bundle = view.render(1.0)
    assert rows(bundle)[0][3].startswith("step 45, loss 0.025 · 45%|")
    progress_cell = re.findall(r"<td ([^>]*)>([^<]*)</td></tr>", bundle["text/html"])[0]
    assert progress_cell[1].startswith("step 45, loss 0.025 · 45%|")
    assert "white-space:pre-wrap" in progress_cell[0] and "nowrap" not in progress_cell[0]


def all_reduce(seq: int, seconds: float) -> Collective:
    return Collective("0", seq, "all_reduce", [[1000]], ["Float"], seconds)


def test_a_row_says_a_collective_that_lasts_and_nothing_for_a_short_one():
    view = RunView("3 ranks on cpu", range(3))
    view.take(0, RankActivity(1.0, 0.5, {"0": 4}, [all_reduce(5, 3.0)]))
    view.take(1, RankActivity(1.0, 0.5, {"0": 4}, [all_reduce(5, 0.2)]))
    view.take(2, RankActivity(1.0, 0.5, {"0": 4}, [all_reduce(5, 3.0)]))
    view.take(2, RankProgress(1.0, 40))
    assert rows(view.render(1.0)) == [
        ["rank 0", "running", "in all_reduce #5 (4 KB float32) 3 s"],
        ["rank 1", "running"],
        ["rank 2", "running", "in all_reduce #5 (4 KB float32) 3 s · step 40"],
    ]
    for rank in range(3):
        view.take(rank, CellEnded(2.0))
    assert "all_reduce" not in view.render(2.0)["text/plain"]  # a rank that is done does nothing
    assert "all_reduce" not in view.summary("done", 2.0)["text/plain"]


def test_a_row_says_a_wait_for_data_that_lasts_and_process_group_setup():
    view = RunView("3 ranks on cpu", range(3))
    view.take(0, RankActivity(1.0, 0.5, waiting="train_loader", waited=2.0))
    view.take(1, RankActivity(1.0, 0.5, waiting="train_loader", waited=0.2))
    view.take(2, RankActivity(1.0, 0.5, setup=5.0, store="10.0.0.1:29400"))
    assert rows(view.render(1.0)) == [
        ["rank 0", "running", "waiting for data 2 s"],
        ["rank 1", "running"],
        ["rank 2", "running", "in process-group setup 5 s"],
    ]


def test_a_row_says_computing_when_the_cpu_rose_between_two_samples():
    view = RunView("2 ranks on cpu", range(2))
    for rank in range(2):
        view.take(rank, RankActivity(1.0, 1.0, {"0": 4}))
    assert [row[2:] for row in rows(view.render(1.0))] == [[], []]  # one sample says nothing of the CPU
    view.take(0, RankActivity(2.0, 1.9, {"0": 4}))
    view.take(1, RankActivity(2.0, 1.01, {"0": 4}))  # a hundredth of a core: it sleeps, or waits on a lock
    assert [row[2:] for row in rows(view.render(2.0))] == [["computing"], []]


def test_a_rank_that_has_not_reached_the_collective_the_others_wait_in_is_behind():
    view = RunView("3 ranks on cpu", range(3))
    view.take(0, RankActivity(1.0, 1.0, {"0": 4}, [all_reduce(5, 3.0)]))
    view.take(1, RankActivity(1.0, 1.0, {"0": 4}, [all_reduce(5, 3.0)]))
    view.take(2, RankActivity(1.0, 1.0, {"0": 4}))
    view.take(2, RankActivity(2.0, 2.0, {"0": 4}))
    assert rows(view.render(2.0))[2] == ["rank 2", "running", "behind: at #4, others wait in #5 · computing"]
    view.take(2, RankActivity(3.0, 2.0, {"0": 4}, [all_reduce(5, 0.1)]))  # it got there
    assert rows(view.render(3.0))[2] == ["rank 2", "running"]


def test_a_sample_older_than_the_others_wait_never_calls_a_rank_behind():
    """Rank 2's last sample came before the others entered #5: it may be there too; its row says nothing yet."""
    view = RunView("3 ranks on cpu", range(3))
    view.take(2, RankActivity(0.1, 0.1, {"0": 4}), now=10.1)
    view.take(0, RankActivity(12.0, 1.0, {"0": 4}, [all_reduce(5, 1.9)]), now=12.0)  # in #5 since 10.1
    view.take(1, RankActivity(12.0, 1.0, {"0": 4}, [all_reduce(5, 1.9)]), now=12.0)
    assert rows(view.render(2.2))[2] == ["rank 2", "running"]
    view.take(2, RankActivity(1.0, 0.1, {"0": 4}), now=10.9)  # still before the others had waited a second
    assert rows(view.render(2.2))[2] == ["rank 2", "running"]
    view.take(2, RankActivity(2.0, 0.1, {"0": 4}), now=12.1)  # taken while they wait: it is behind
    assert rows(view.render(2.3))[2] == ["rank 2", "running", "behind: at #4, others wait in #5"]


def test_the_summary_has_peaks_and_throughput():
    view = RunView("2 ranks on cpu", range(2))
    view.take(0, RankVitals(1.0, 300 * MB, 900 * MB))
    view.take(0, RankProgress(1.0, 0, {}))
    view.take(0, RankProgress(11.0, 100, {}))
    view.take(1, RankVitals(1.0, 200 * MB, 250 * MB))
    view.bar(1, "100%|##########| 100/100 [00:10<00:00, 9.87it/s]")
    for rank in range(2):
        view.take(rank, CellEnded(12.0))
    summary = view.summary("done", 12.3)
    assert summary["text/plain"].splitlines()[0] == "taas: 2 ranks on cpu · done in 12.3 s"
    assert rows(summary) == [
        ["rank 0", "done", "peak 900 MB", "10.0 steps/s · step 100"],
        ["rank 1", "done", "peak 250 MB", "9.87 it/s · 100%|##########| 100/100 [00:10<00:00, 9.87it/s]"],
    ]
    assert 'data-state="summary"' in summary["text/html"]
    assert view.summary("failed", 3.0)["text/plain"].startswith("taas: 2 ranks on cpu · failed after 3.0 s")


def test_a_cluster_run_has_a_row_per_node():
    view = RunView("4 ranks on cpu", range(4), ranks_per_node=2)
    for rank in range(4):
        view.take(rank, RankVitals(1.0, 100 * MB, 100 * MB))
    view.take(2, CellEnded(2.0))
    node_rows = [row for row in rows(view.render(2.0)) if row[0].startswith("node")]
    assert node_rows == [["node 0", "2 running", "200 MB"], ["node 1", "1 running, 1 done", "200 MB"]]


def test_the_html_is_one_table_with_a_row_per_rank_and_escapes_what_ranks_print():
    view = RunView("2 ranks on cpu", range(2))
    view.bar(1, "<script>alert(1)</script> 10%")
    html = view.render(1.0)["text/html"]
    assert html.count('<table class="taas-view" data-state="running"') == 1
    assert html.count('class="taas-row"') == 2 and 'data-rank="1"' in html
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_only_a_change_asks_for_a_redraw():
    view = RunView("1 rank on cpu", [0])
    view.changed = False
    view.bar(0, "10%")
    assert view.changed
    view.changed = False
    view.take(0, RankVitals(1.0, MB, MB))
    assert view.changed
    view.changed = False
    view.take(7, RankVitals(1.0, MB, MB))  # not a rank of this view (a session cell's --ranks)
    assert not view.changed


def test_a_rank_stopped_in_the_notebooks_debugger_reads_paused_until_it_goes_on():
    view = RunView("2 ranks on cpu", range(2))
    for rank in range(2):
        view.take(rank, RankVitals(1.0, 300 * MB, 310 * MB))
    view.changed = False
    view.in_debugger(frozenset({1}))
    assert view.changed and [row[1] for row in rows(view.render(1.0))] == ["running", "paused"]
    view.changed = False
    view.in_debugger(frozenset({1}))
    assert not view.changed, "the same ranks again: nothing to redraw"
    view.take(1, CellEnded(2.0))
    assert [row[1] for row in rows(view.render(2.0))] == ["running", "done"], "an ended rank is not paused"
    view.in_debugger(frozenset())
    assert [row[1] for row in rows(view.summary("done", 3.0))][1] == "done"


def test_a_summary_says_no_node_or_loader_still_runs():
    """Once the run is over nothing runs: a node whose ranks had not said how they ended (the run was lost)
    counts them stopped, as their own rows do, and so does a loader that had not finished."""
    view = RunView("4 ranks on cpu", range(4), ranks_per_node=2)
    for rank in range(4):
        view.take(rank, RankVitals(1.0, 100 * MB, 100 * MB))
    view.take(2, CellEnded(2.0))
    view.take(0, DeliveryProgress("loader", 1.0, 4, [1, 1, 1, 1], [0, 0, 0, 0], 0, [0, 0, 1, 0]))
    summary = view.summary("lost", 30.1)
    assert summary["text/plain"].startswith("taas: 4 ranks on cpu · lost after 30.1 s")
    extra = [row[:2] for row in rows(summary) if not row[0].startswith("rank")]
    assert extra == [["node 0", "2 stopped"], ["node 1", "1 done, 1 stopped"], ["loader", "stopped"]], extra
    assert "running" not in summary["text/plain"] and "starting" not in summary["text/plain"]
