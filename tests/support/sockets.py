"""The machine's TCP and UDP sockets whose peer is beyond loopback, and which processes hold them: what
the cluster tier's watch looks at many times a second for minutes (tests/e2e/cluster/conftest.py).

They are asked of the kernel over netlink (``sock_diag``, as ``ss`` does): about 5 ms a look here, most of it
the kernel walking its TCP hash table once for IPv4 and once for IPv6, however few sockets it holds.
psutil's ``net_connections`` reads every descriptor of every process, and /proc/net/tcp and tcp6 cost
8 ms a read of both.
A socket's owner is looked for only when it has a peer beyond loopback, in the processes named.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Iterator
from typing import NamedTuple

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST_DUMP = 0x301
NLMSG_DONE, NLMSG_ERROR = 3, 2
TCP_LISTEN = 10
IPPROTO_TCP, IPPROTO_UDP = 6, 17

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Socket(NamedTuple):
    protocol: int
    state: int
    local_port: int
    peer: Address
    peer_port: int
    inode: int  # 0 once its process closed it (TCP's TIME_WAIT, for a minute)

    @property
    def peer_text(self) -> str:
        return f"{self.peer}:{self.peer_port}"


def sockets() -> Iterator[Socket]:
    """Every TCP and UDP socket of this network namespace, IPv4 and IPv6."""
    for family in (socket.AF_INET, socket.AF_INET6):
        for protocol in (IPPROTO_TCP, IPPROTO_UDP):
            yield from _dump(family, protocol)


def _dump(family: int, protocol: int) -> Iterator[Socket]:
    request = struct.pack("=BBBBI", family, protocol, 0, 0, 0xFFFFFFFF) + bytes(48)  # every state
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as diag:
        diag.send(struct.pack("=IHHII", 16 + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST_DUMP, 1, 0) + request)
        while True:
            data, offset = diag.recv(1 << 16), 0
            while offset < len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:  # a kernel without this protocol's diagnostics
                    return
                yield _socket(protocol, data, offset + 16)
                offset += (length + 3) & ~3


def _socket(protocol: int, data: bytes, at: int) -> Socket:
    """One ``inet_diag_msg``: family and state, then the ports (big-endian), the two addresses, the inode."""
    family, state = struct.unpack_from("=BB", data, at)
    local_port, peer_port = struct.unpack_from(">HH", data, at + 4)
    size = 4 if family == socket.AF_INET else 16
    peer = ipaddress.ip_address(data[at + 24 : at + 24 + size])
    (inode,) = struct.unpack_from("=I", data, at + 68)
    return Socket(protocol, state, local_port, peer, peer_port, inode)


def beyond_loopback(peer: Address) -> bool:
    mapped = peer.ipv4_mapped if isinstance(peer, ipaddress.IPv6Address) else None
    shown = mapped or peer
    return not (peer.is_unspecified or shown.is_unspecified or shown.is_loopback)


def outward(found: Iterable[Socket]) -> list[Socket]:
    """The sockets that talk to a peer beyond loopback and that this machine opened (not ones accepted
    on a port it listens on)."""
    found = list(found)
    listening = {s.local_port for s in found if s.protocol == IPPROTO_TCP and s.state == TCP_LISTEN}
    return [
        s for s in found if beyond_loopback(s.peer) and not (s.protocol == IPPROTO_TCP and s.local_port in listening)
    ]


def holders(inodes: Iterable[int], pids: Iterable[int]) -> dict[int, int]:
    """``{inode: pid}`` for the sockets among ``inodes`` that one of ``pids`` holds open."""
    wanted = {f"socket:[{inode}]": inode for inode in inodes}
    found = {}
    for pid in pids:
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        for fd in descriptors:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in wanted:
                found[wanted[target]] = pid
    return found
