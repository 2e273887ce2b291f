"""A forked process's ``print``: each call's text reaches its own streams in one write, exactly as the built-in
would have written it; any other file is printed to as the built-in does."""

from __future__ import annotations

import builtins
import io
import os
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taas_magic.process.child import print_in_one_write


class CountingFile(io.RawIOBase):
    """A raw file that keeps each write it is given, as a pipe would receive them."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return len(data)


def own_stream() -> tuple[io.TextIOWrapper, CountingFile]:
    """A stream made as a rank's are: line buffered, writing through."""
    raw = CountingFile()
    return io.TextIOWrapper(
        raw, encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True
    ), raw


class Slow:
    def __str__(self) -> str:
        return "slow"


VALUES = st.lists(
    st.one_of(
        st.none(), st.integers(), st.floats(), st.text(), st.binary(), st.booleans(), st.builds(Slow), st.just([None])
    ),
    max_size=5,
)
SEPARATORS = st.one_of(st.none(), st.text(max_size=3))


@given(values=VALUES, sep=SEPARATORS, end=SEPARATORS, flush=st.booleans())
def test_each_call_is_one_write_of_what_the_builtin_writes(values, sep, end, flush):
    stream, raw = own_stream()
    expected = io.StringIO()
    builtins.print(*values, sep=sep, end=end, file=expected)
    one_write = print_in_one_write(builtins.print, (stream, sys.stderr))
    one_write(*values, sep=sep, end=end, file=stream, flush=flush)
    written = expected.getvalue().encode("utf-8", "backslashreplace")
    assert raw.writes == ([written] if written else []), "one write, the built-in's text"


def test_without_a_file_it_prints_to_stdout_as_it_is_now():
    stream, raw = own_stream()
    saved = sys.stdout
    sys.stdout = stream
    try:
        print_in_one_write(builtins.print, (stream,))("pid", os.getpid(), None)
    finally:
        sys.stdout = saved
    assert raw.writes == [f"pid {os.getpid()} None\n".encode()]


def test_another_file_is_written_as_the_builtin_writes_it():
    mine, _ = own_stream()
    other, raw = own_stream()
    print_in_one_write(builtins.print, (mine,))("a", "b", file=other)
    assert raw.writes == [b"a", b" ", b"b", b"\n"], "not one of the process's streams: untouched"


@pytest.mark.parametrize("bad", [{"sep": 1}, {"end": b"\n"}])
def test_wrong_arguments_raise_as_the_builtin_raises(bad):
    stream, raw = own_stream()
    with pytest.raises(TypeError) as builtin_error:
        builtins.print("x", file=io.StringIO(), **bad)
    with pytest.raises(TypeError) as one_write_error:
        print_in_one_write(builtins.print, (stream,))("x", file=stream, **bad)
    assert str(one_write_error.value) == str(builtin_error.value)
    assert raw.writes == [], "nothing written"
