"""The authenticated channel: whole messages, large bodies, and nothing accepted from outside."""

from __future__ import annotations

import os

import pytest

from taas_magic.wire.channel import INLINE_LIMIT, Channel, ChannelBroken, new_secret, socket_pair


@pytest.fixture
def pair():
    left, right = socket_pair()
    secret = new_secret()
    a, b = Channel(left, secret, "run-1"), Channel(right, secret, "run-1")
    yield a, b
    a.close()
    b.close()


def test_messages_arrive_whole_in_order_with_their_descriptors(pair):
    a, b = pair
    read_end, write_end = os.pipe()
    try:
        a.send("first", 1, {"x": [1, 2]})
        a.send("second", fds=[read_end])
        assert b.receive()[:2] == ("first", (1, {"x": [1, 2]}))
        kind, fields, fds = b.receive()
        assert (kind, fields, len(fds)) == ("second", (), 1)
        os.write(write_end, b"!")
        assert os.read(fds[0], 1) == b"!"
        os.close(fds[0])
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_body_larger_than_a_datagram_travels_in_a_memory_file(pair):
    a, b = pair
    big = os.urandom(5 * INLINE_LIMIT)
    a.send("big", big)
    kind, (received,), fds = b.receive()
    assert received == big and fds == []
    assert not any("taas-message" in os.readlink(f"/proc/self/fd/{fd}") for fd in map(int, os.listdir("/proc/self/fd"))
                   if os.path.exists(f"/proc/self/fd/{fd}")), "the memory file is closed on both sides"


def test_a_peer_without_the_secret_is_refused(pair):
    a, b = pair
    Channel(a.sock, new_secret(), "run-1").send("events", ["forged"])  # the same socket, another secret
    with pytest.raises(ChannelBroken, match="authentication"):
        b.receive()


def test_raw_bytes_are_refused(pair):
    a, b = pair
    a.sock.send(b"\x00" * 80)
    with pytest.raises(ChannelBroken):
        b.receive()


def test_a_replayed_sequence_number_is_refused(pair):
    a, b = pair
    a.send("once")
    assert b.receive()[0] == "once"
    Channel(a.sock, b._secret, "run-1").send("again")  # knows the secret, but numbers its messages from 1 again
    with pytest.raises(ChannelBroken, match="after message"):
        b.receive()


def test_a_message_of_another_run_is_refused(pair):
    a, b = pair
    Channel(a.sock, b._secret, "run-old").send("events", [])
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
            a.send("lost")
    a.send("next")
    assert b.receive()[0] == "next"


def test_a_closed_peer_breaks_the_channel(pair):
    a, b = pair
    a.close()
    with pytest.raises(ChannelBroken, match="closed"):
        b.receive()


def test_last_words_arrive_even_when_they_crossed_a_request_the_peer_never_read(pair):
    a, b = pair
    a.send("signal", 15)  # a request the other side will not read: it is done
    b.send("closed", {0: 0})
    b.close()
    assert a.receive()[:2] == ("closed", ({0: 0},))
    with pytest.raises(ChannelBroken, match="closed the channel"):
        a.receive()
