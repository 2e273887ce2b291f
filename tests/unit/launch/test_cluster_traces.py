"""A --profile run's traces on a cluster node: sent once each, whole, and written only under a trace's name."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from taas_magic.launch.cluster.traces import NodeTraces, write_into


def test_a_node_sends_each_whole_trace_once_and_none_still_being_written(tmp_path):
    traces = NodeTraces(str(tmp_path / "node-"))
    assert traces.take() == {}, "no run, no folder"
    folder = traces.open()
    assert os.path.isdir(folder) and traces.open() == folder, "one folder for the run"
    for name, data in (("rank-0.json", b"{}"), ("rank-1.json.part", b"{"), ("notes.txt", b"x")):
        with open(os.path.join(folder, name), "wb") as file:
            file.write(data)
    assert traces.take() == {"rank-0.json": b"{}"}
    assert traces.take() == {}, "sent once"
    os.replace(os.path.join(folder, "rank-1.json.part"), os.path.join(folder, "rank-1.json"))
    assert traces.take() == {"rank-1.json": b"{"}
    traces.close()
    assert not os.path.exists(folder) and traces.take() == {}


def test_the_kernel_writes_what_a_node_sent_into_the_runs_folder(tmp_path):
    write_into(str(tmp_path), {"rank-3.json": b"{}", "rank-12.json": b"[]"})
    assert sorted(os.listdir(tmp_path)) == ["rank-12.json", "rank-3.json"]
    write_into(None, {"rank-4.json": b"{}"})  # a run without --profile: dropped
    write_into(str(tmp_path / "gone"), {"rank-5.json": b"{}"})  # the cell's folder went: dropped, nothing raised
    assert sorted(os.listdir(tmp_path)) == ["rank-12.json", "rank-3.json"]


@given(st.text(min_size=1, max_size=40))
def test_no_name_a_node_sends_places_a_file_outside_the_runs_folder_or_under_another_name(tmp_path_factory, name):
    folder = tmp_path_factory.mktemp("profile")
    write_into(str(folder), {name: b"{}"})
    written = os.listdir(folder)
    assert written in ([], [name]), written
    if written:
        assert name.startswith("rank-") and name.endswith(".json") and name[5:-5].isascii() and name[5:-5].isdecimal()
