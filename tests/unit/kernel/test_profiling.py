"""A --profile run's traces merged into one (kernel/running/profiling.py), and the picture of the ranks' time
(kernel/view/time_picture.py), without a process."""

from __future__ import annotations

import gzip
import json
import os
import xml.etree.ElementTree as ElementTree

from hypothesis import given
from hypothesis import strategies as st

from taas_magic.kernel.running.profiling import ROWS_PER_RANK, ProfileFolder, kept_traces, merge
from taas_magic.kernel.view.time_picture import bundle
from taas_magic.kernel.view.time_shares import Shares
from taas_magic.wire.records import Collective, RankActivity


def rank_trace(pid: int, base_ns: int, start_us: float, gpu: bool = False) -> dict:
    """A trace as torch.profiler exports it: times relative to its process's base, its own process ids."""
    events = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": 5}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": pid, "tid": pid, "ts": start_us, "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "pid": pid, "tid": pid, "ts": start_us + 20, "dur": 5},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x", "ts": start_us},
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": start_us + 30},
        {"ph": "s", "id": 7, "pid": pid, "tid": pid, "ts": start_us + 1, "cat": "ac2g", "name": "launch"},
    ]
    if gpu:
        events += [
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": start_us + 2, "dur": 3},
            {"ph": "f", "id": 7, "pid": 0, "tid": 7, "ts": start_us + 2, "cat": "ac2g", "name": "launch", "bp": "e"},
        ]
    return {"baseTimeNanoseconds": base_ns, "traceEvents": events, "deviceProperties": [{"id": 0}] if gpu else []}


def names(merged: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}


def test_each_ranks_trace_is_rows_of_its_own_named_after_it() -> None:
    merged = merge({0: rank_trace(4242, 10**12, 500.0, gpu=True), 1: rank_trace(4343, 10**12, 500.0)})
    assert names(merged) == {0: "rank 0", 1: "rank 0 · GPU 0", ROWS_PER_RANK: "rank 1"}
    pids = {e["pid"] for e in merged["traceEvents"]}
    assert pids == {0, 1, ROWS_PER_RANK}, "the profiler's own marks go to the rank's row, not rows of their own"
    flows = {(e["pid"], e["id"]) for e in merged["traceEvents"] if e.get("ph") in ("s", "f")}
    assert flows == {(0, "0:7"), (1, "0:7"), (ROWS_PER_RANK, "1:7")}, "a rank's flows keep their ends, apart"
    assert merged["deviceProperties"] == [{"id": 0}]


def test_the_ranks_times_line_up_from_the_runs_first_event() -> None:
    """Rank 1's base is 2 ms later and its events 100 µs earlier on it: 1.9 ms after rank 0's."""
    merged = merge({0: rank_trace(1, 10**12, 500.0), 1: rank_trace(2, 10**12 + 2_000_000, 400.0)})
    mm = {e["pid"]: e["ts"] for e in merged["traceEvents"] if e.get("name") == "aten::mm"}
    assert mm == {0: 0.0, ROWS_PER_RANK: 1900.0}
    assert min(e["ts"] for e in merged["traceEvents"] if "ts" in e) == 0.0


@given(st.dictionaries(st.integers(0, 63), st.tuples(st.integers(1, 10**6), st.integers(0, 10**15)), min_size=1))
def test_any_ranks_traces_merge_into_rows_that_do_not_collide(ranks: dict[int, tuple[int, int]]) -> None:
    merged = merge({rank: rank_trace(pid, base, 0.0) for rank, (pid, base) in ranks.items()})
    assert names(merged) == {rank * ROWS_PER_RANK: f"rank {rank}" for rank in ranks}
    assert all(e["ts"] >= 0 for e in merged["traceEvents"] if "ts" in e)
    json.dumps(merged)  # what is written


def test_the_folder_merges_what_the_ranks_wrote_and_goes(tmp_path) -> None:
    traces = ProfileFolder()
    try:
        for rank in (0, 1):
            with open(os.path.join(traces.path, f"rank-{rank}.json"), "w") as file:
                json.dump(rank_trace(100 + rank, 10**12, 0.0), file)
        with open(os.path.join(traces.path, "rank-2.json"), "w") as file:
            file.write('{"traceEvents": [')  # cut short as its rank was killed
        written = traces.merge_into(str(tmp_path))
    finally:
        traces.close()
    assert not os.path.exists(traces.path)
    assert written is not None and written.ranks == (0, 1) and os.path.dirname(written.path) == str(tmp_path)
    assert os.path.basename(written.path).startswith("taas-profile-") and written.size == os.path.getsize(written.path)
    assert written.path.endswith(".json.gz"), "compressed: Perfetto and chrome://tracing open it as it is"
    assert "ranks 2-3 wrote none" in written.notice(4) and "ui.perfetto.dev" in written.notice(2)
    assert "traces in this folder" not in written.notice(2), "the first trace is all there is"
    assert names(json.load(gzip.open(written.path))) == {0: "rank 0", ROWS_PER_RANK: "rank 1"}
    again = ProfileFolder()
    try:
        with open(os.path.join(again.path, "rank-0.json"), "w") as file:
            json.dump(rank_trace(1, 10**12, 0.0), file)
        second = again.merge_into(str(tmp_path))
    finally:
        again.close()
    assert second is not None and second.path != written.path, "a run of the same second keeps the first's file"
    total = written.size + second.size
    assert kept_traces(str(tmp_path)) == (2, total)
    assert f"; 2 traces in this folder, {total / 1e6:.1f} MB)" in second.notice(1), second.notice(1)


def test_a_folder_no_rank_wrote_in_merges_nothing(tmp_path) -> None:
    traces = ProfileFolder()
    try:
        assert traces.merge_into(str(tmp_path)) is None and os.listdir(tmp_path) == []
    finally:
        traces.close()


def test_the_picture_is_svg_with_a_bar_per_rank_and_its_figures_as_text() -> None:
    shares = {}
    for rank, waits in ((0, 8), (1, 0), (2, 8)):
        shares[rank] = Shares()
        for second in range(10):
            inside = [Collective("0", second, "all_reduce", [[1]], ["Float"], 0.1)] if second < waits else []
            shares[rank].add(RankActivity(second, 0.0, collectives=inside))
    shown = bundle(shares)
    picture = ElementTree.fromstring(shown["image/svg+xml"])
    texts = [element.text for element in picture.iter("{http://www.w3.org/2000/svg}text")]
    assert {"rank 0", "rank 1", "rank 2"} <= set(texts)
    assert "the others waited for rank 1: 80% of their time in all_reduce" in texts
    assert shown["text/plain"].splitlines() == [
        "rank 0: all_reduce 80% · computing 20%",
        "rank 1: computing 100%",
        "rank 2: all_reduce 80% · computing 20%",
        "the others waited for rank 1: 80% of their time in all_reduce",
    ]
