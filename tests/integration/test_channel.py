"""The authenticated channel: whole messages, large bodies, and nothing accepted from outside."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import pytest

from taas_magic.wire.channel import INLINE_LIMIT, Channel, ChannelBroken, new_secret, socket_pair


@dataclass(frozen=True)
class Note:
    """A message of the tests' own protocol."""

    text: str
    data: Any = None


@dataclass(frozen=True)
class Bye:
    kind: ClassVar[str] = "bye"


Message = Union[Note, Bye]


@dataclass(frozen=True)
class Stray:
    """A message of no protocol of these ends."""


def end(sock, secret, run_id="run-1") -> Channel[Message, Message]:
    return Channel(sock, secret, run_id, receives=Message)


@pytest.fixture
def pair():
    left, right = socket_pair()
    secret = new_secret()
    a, b = end(left, secret), end(right, secret)
    yield a, b
    a.close()
    b.close()


def test_messages_arrive_whole_in_order_with_their_descriptors(pair):
    a, b = pair
    read_end, write_end = os.pipe()
    try:
        a.send(Note("first", {"x": [1, 2]}))
        a.send(Bye(), fds=[read_end])
        assert b.receive() == (Note("first", {"x": [1, 2]}), [])
        message, fds = b.receive()
        assert (message, len(fds)) == (Bye(), 1)
        os.write(write_end, b"!")
        assert os.read(fds[0], 1) == b"!"
        os.close(fds[0])
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_body_larger_than_a_datagram_travels_in_a_memory_file(pair):
    a, b = pair
    big = os.urandom(5 * INLINE_LIMIT)
    a.send(Note("big", big))
    received, fds = b.receive()
    assert received == Note("big", big) and fds == []
    assert not any(
        "taas-message" in os.readlink(f"/proc/self/fd/{fd}")
        for fd in map(int, os.listdir("/proc/self/fd"))
        if os.path.exists(f"/proc/self/fd/{fd}")
    ), "the memory file is closed on both sides"


def test_a_large_body_arrives_whole_when_the_system_writes_and_reads_it_in_pieces(pair, monkeypatch):
    """``pwrite`` and ``pread`` may move fewer bytes than asked (a large buffer, a signal on the way): a
    large session result once failed authentication that way, its body cut short."""
    a, b = pair
    write, read = os.pwrite, os.pread
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: write(fd, memoryview(data)[:100_000], offset))
    monkeypatch.setattr(os, "pread", lambda fd, size, offset: read(fd, min(size, 70_000), offset))
    big = os.urandom(40 * INLINE_LIMIT + 12345)
    a.send(Note("big", big))
    assert b.receive() == (Note("big", big), [])


def test_a_peer_without_the_secret_is_refused(pair):
    a, b = pair
    end(a.sock, new_secret()).send(Note("forged"))  # the same socket, another secret
    with pytest.raises(ChannelBroken, match="authentication"):
        b.receive()


def test_raw_bytes_are_refused(pair):
    a, b = pair
    a.sock.send(b"\x00" * 80)
    with pytest.raises(ChannelBroken):
        b.receive()


def test_a_replayed_sequence_number_is_refused(pair):
    a, b = pair
    a.send(Note("once"))
    assert b.receive()[0] == Note("once")
    end(a.sock, b._secret).send(Note("again"))  # knows the secret, but numbers its messages from 1 again
    with pytest.raises(ChannelBroken, match="after message"):
        b.receive()


def test_a_message_of_another_run_is_refused(pair):
    a, b = pair
    end(a.sock, b._secret, "run-old").send(Note("old"))
    with pytest.raises(ChannelBroken, match="run-old"):
        b.receive()


def test_an_interrupted_send_leaves_a_gap_never_a_half_message(pair, monkeypatch):
    a, b = pair
    import socket as socket_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(socket_module.socket, "sendall", interrupted)
        with pytest.raises(KeyboardInterrupt):
            a.send(Note("lost"))
    a.send(Note("next"))
    assert b.receive()[0] == Note("next")


def test_a_closed_peer_breaks_the_channel(pair):
    a, b = pair
    a.close()
    with pytest.raises(ChannelBroken, match="closed"):
        b.receive()


def test_last_words_arrive_even_when_they_crossed_a_request_the_peer_never_read(pair):
    a, b = pair
    a.send(Note("signal", 15))  # a request the other side will not read: it is done
    b.send(Note("closed", {0: 0}))
    b.close()
    assert a.receive() == (Note("closed", {0: 0}), [])
    with pytest.raises(ChannelBroken, match="closed the channel"):
        a.receive()


def test_a_message_of_another_protocol_is_refused_and_its_descriptors_closed(pair):
    a, b = pair
    read_end, write_end = os.pipe()
    try:
        Channel(a.sock, b._secret, "run-1").send(Stray(), fds=[read_end])  # authentic, but not a message b takes
        before = set(os.listdir("/proc/self/fd"))
        with pytest.raises(ChannelBroken, match="unexpected message 'Stray'"):
            b.receive()
        assert set(os.listdir("/proc/self/fd")) <= before, "the descriptor that came with it is closed"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_failed_send_names_the_message_by_its_kind(pair):
    a, b = pair
    b.close()
    with pytest.raises(ChannelBroken, match="could not send 'bye'"):
        for _ in range(100):  # the first sends may still fit in the socket's buffer
            a.send(Bye())
