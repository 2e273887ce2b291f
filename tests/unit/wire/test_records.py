"""Records travel as JSON lines on a report pipe and come back as the same typed values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taas_magic.wire import records
from taas_magic.wire.records import (
    CellEnded,
    Collective,
    DeliveryProgress,
    DeliverySummary,
    Failed,
    RankActivity,
    SaveSkipped,
)


@pytest.mark.parametrize(
    "record",
    [
        CellEnded(12.5, {"lock": "cannot be pickled"}, {"train": DeliverySummary(32, 0.5, 0.01, 3.0)}, "sys.exit(0)"),
        CellEnded(1.0),
        Failed(3.0, "ValueError", "boom", ["Traceback", "  line 1"], hint="use taas.device()"),
        Failed(4.0, "KeyboardInterrupt", "", interrupted=True),
        Failed(5.0, "OSError", "disk", where="at element 5 of pass 0 (samples 10-19)"),
        DeliveryProgress("train", 7.0, 20, [5, 5], [0, 2], 10, [0, 1]),
        SaveSkipped("model.pt"),
        RankActivity(
            9.0,
            3.5,
            {"0": 1234},
            [
                Collective("0", 1235, "all_reduce", [[1000, 1000]], ["Float"], 118.0),
                Collective("1", 3, "send", [[8]], ["Long"], 2.0, p2p=True),
            ],
        ),
        RankActivity(9.0, 3.5, waiting="train_loader", waited=2.5, taken=40),
        RankActivity(9.0, 0.1, setup=40.0, store="10.0.0.1:29400"),
    ],
)
def test_every_kind_comes_back_as_it_was_sent(record) -> None:
    line = records.encode(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert records.decode(line) == record


@pytest.mark.parametrize(
    "line",
    [
        b"not json\n",
        b"[1, 2]\n",
        b'{"kind": "Unknown"}\n',
        b'{"kind": "Failed"}\n',
        b'{"time": 1.0}\n',
        b'{"kind": "CellEnded", "time": 1, "delivery": 3}\n',
        b'{"kind": "RankActivity", "at": 1, "cpu": 1, "collectives": [{"op": "x"}]}\n',
        b'{"kind": "RankActivity", "at": 1, "cpu": 1, "collectives": 3}\n',
    ],
)
def test_a_line_that_is_no_record_becomes_a_failure_that_says_so(line: bytes) -> None:
    record = records.decode(line)
    assert isinstance(record, Failed) and record.ename == "ProtocolError" and "unreadable report" in record.evalue


NUMBERS = st.floats(allow_nan=False)
COLLECTIVES = st.builds(
    Collective,
    group=st.text(),
    seq=st.integers(),
    op=st.text(),
    shapes=st.lists(st.lists(st.integers(0, 2**40), max_size=4), max_size=3),
    dtypes=st.lists(st.text(), max_size=3),
    seconds=NUMBERS,
    p2p=st.booleans(),
)
ACTIVITIES = st.builds(
    RankActivity,
    at=NUMBERS,
    cpu=NUMBERS,
    finished=st.dictionaries(st.text(), st.integers()),
    collectives=st.lists(COLLECTIVES, max_size=4),
    waiting=st.text(),
    waited=NUMBERS,
    taken=st.integers(0),
    setup=st.none() | NUMBERS,
    store=st.text(),
)


@settings(max_examples=200, deadline=None)
@given(ACTIVITIES)
def test_any_activity_comes_back_with_its_collectives(activity: RankActivity) -> None:
    line = records.encode(activity)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = records.decode(line)
    assert back == activity and all(isinstance(c, Collective) for c in back.collectives)
