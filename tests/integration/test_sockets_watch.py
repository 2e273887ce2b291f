"""The cluster tier's watch on connections that leave the machine (tests/support/sockets.py), tried on
sockets whose peers are known: a watch that saw nothing would pass every test it guards. A connected
UDP socket sends nothing, so nothing leaves the machine here."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import sockets

HOLDER = """
import socket, sys
held = []
for family, address in [(socket.AF_INET, ("192.0.2.7", 53)), (socket.AF_INET6, ("2001:db8::9", 8080)),
                        (socket.AF_INET, ("127.0.0.5", 9)), (socket.AF_INET6, ("::1", 9))]:
    s = socket.socket(family, socket.SOCK_DGRAM)
    s.connect(address)
    held.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def holder():
    process = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    yield process
    process.communicate("")


def test_a_process_s_sockets_to_peers_beyond_loopback_are_found_and_loopback_ones_are_not(holder):
    found = {s.inode: s for s in sockets.outward(sockets.sockets()) if s.inode}
    held = {found[inode].peer_text for inode in sockets.holders(found, [holder.pid])}
    assert held == {"192.0.2.7:53", "2001:db8::9:8080"}


def test_a_loopback_connection_and_a_listening_socket_are_not_outward():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
        accepted, _ = server.accept()
        with accepted:
            found = {s.inode for s in sockets.outward(sockets.sockets()) if s.inode}
            assert not sockets.holders(found, [os.getpid()])


def test_a_connection_accepted_on_a_listening_port_is_not_outward():
    listening = sockets.Socket(sockets.IPPROTO_TCP, sockets.TCP_LISTEN, 2024, ipaddress.ip_address("0.0.0.0"), 0, 7)
    accepted = sockets.Socket(sockets.IPPROTO_TCP, 1, 2024, ipaddress.ip_address("192.0.2.1"), 40000, 8)
    opened = sockets.Socket(sockets.IPPROTO_TCP, 6, 41000, ipaddress.ip_address("169.254.169.254"), 80, 0)
    assert sockets.outward([listening, accepted, opened]) == [opened]


@given(st.ip_addresses())
def test_only_a_peer_that_is_neither_loopback_nor_unset_is_beyond_loopback(ip):
    shown = getattr(ip, "ipv4_mapped", None) or ip
    assert sockets.beyond_loopback(ip) == (not (shown.is_loopback or shown.is_unspecified or ip.is_unspecified))
