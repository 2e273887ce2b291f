"""A rank's sampling thread reads its supervisor's stack requests from a pipe: never from a file of the cell's."""

from __future__ import annotations

import os

from taas_magic.rank import vitals


def test_a_request_is_seen_on_the_ask_pipe_and_a_file_in_its_place_is_left_alone(monkeypatch):
    asked, ask = os.pipe()
    monkeypatch.setattr(vitals, "_asked", asked)
    monkeypatch.setattr(vitals, "_asked_pipe", os.fstat(asked).st_ino)
    try:
        assert vitals._asked_meanwhile(0.01) is False
        os.write(ask, b"?")
        assert vitals._asked_meanwhile(0.01) is True
        # The cell closes the descriptor and a pipe of its own takes the number (os.closerange, then os.pipe).
        mine, theirs = os.pipe()
        os.dup2(mine, asked)
        os.write(theirs, b"the cell's")
        assert vitals._asked_meanwhile(0.01) is False and vitals._asked is None
        assert os.read(asked, 100) == b"the cell's", "nothing of the cell's was read"
        for fd in (mine, theirs):
            os.close(fd)
    finally:
        os.close(asked)
        os.close(ask)
