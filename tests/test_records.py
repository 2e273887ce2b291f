"""Records travel as JSON lines on a report pipe and come back as the same typed values."""

from __future__ import annotations

import pytest

from taas_magic.wire import records
from taas_magic.wire.records import CellEnded, DeliveryProgress, DeliverySummary, Failed, SaveSkipped


@pytest.mark.parametrize("record", [
    CellEnded(12.5, {"lock": "cannot be pickled"}, {"train": DeliverySummary(32, 0.5, 0.01, 3.0)}, "sys.exit(0)"),
    CellEnded(1.0),
    Failed(3.0, "ValueError", "boom", ["Traceback", "  line 1"], hint="use taas.device()"),
    Failed(4.0, "KeyboardInterrupt", "", interrupted=True),
    Failed(5.0, "OSError", "disk", where="at element 5 of pass 0 (samples 10-19)"),
    DeliveryProgress("train", 7.0, 20, [5, 5], [0, 2], 10, [0, 1]),
    SaveSkipped("model.pt"),
])
def test_every_kind_comes_back_as_it_was_sent(record) -> None:
    line = records.encode(record)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert records.decode(line) == record


@pytest.mark.parametrize("line", [b"not json\n", b"[1, 2]\n", b'{"kind": "Unknown"}\n', b'{"kind": "Failed"}\n',
                                  b'{"time": 1.0}\n', b'{"kind": "CellEnded", "time": 1, "delivery": 3}\n'])
def test_a_line_that_is_no_record_becomes_a_failure_that_says_so(line: bytes) -> None:
    record = records.decode(line)
    assert isinstance(record, Failed) and record.ename == "ProtocolError" and "unreadable report" in record.evalue
