"""Data delivery across a cluster's nodes: producers on CPU nodes, their elements relayed to the ranks.

    host node:  fork server ─ producers ──► channels, one per rank ──► agent (streams out)
                                                                            │ TCP, one stream per loader and
                                                                            │ node of ranks (``relay.py``)
    rank node:  agent (reads in) ──► channels, one per local rank ──► fork server's ranks (stand-ins)

Producers and stand-ins are the ones of a single machine (``producer.py``, ``standin.py``): the
same stream plan, seeding, order, ``--units``, window and errors. What differs is who holds the
other end of each channel. On a host node the agent holds every rank's end and streams what
arrives to the node of that rank; on a rank node the agent holds the producers' end of each of
its ranks' channels and puts in what the stream brings. Each element is read once from the host's
channel and written once into the rank's, so it is still delivered exactly once.

Why a stream of our own and not Ray. Elements used to travel as the answers of Ray calls (a rank
node pulled, the host answered with what waited): each 3.2 MB batch was copied into the host's
object store, moved by Ray's object manager into the rank node's store (gRPC, in chunks), and
copied from there into a memory file for the rank, about 10 ms of CPU per batch on this machine
(every process counted) and at most about 180 batches a second between two nodes, however many
were pulled at once. Here the host hands the producer's memory file to a TCP socket (``sendfile``:
no copy in user space) and the rank node reads the bytes into a new memory file: one copy more
than on one machine, and no pickling, since neither agent unpickles an element. Ray carries only
the question "where do I connect?" (``relay_address``), once per run and host.

Each stream is proven at connection, both ways, with a secret the kernel makes for the run and
sends to the agents through Ray (never to the fork server's processes): whoever lacks it can
neither feed a rank a pickle nor read one. A host listens for the run only, on loopback when the
only node that reads from it is itself, else on its node's address.

Counters cannot be shared memory between machines, but each has one writer: every node keeps a
full copy and copies in the rows others own (``Counters.take_rows``). A rank node sends its
copy up each stream whenever it changes, so the hosts' producers stay within the window of the
slowest rank; the kernel merges every node's copy into the progress line.

This module is the agent's side: ``NodeDelivery``, made per run by each node's agent. The kernel's
word to each agent and the progress line it merges are in ``cluster_share.py``; what the run's
supervisor (forked from the fork server) and its ranks make of the channels, in ``cluster_ends.py``.
"""

from __future__ import annotations

import dataclasses
import os
import select
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from taas_magic.delivery import relay
from taas_magic.delivery.cluster_ends import NodeEnds
from taas_magic.delivery.cluster_share import NodeShare
from taas_magic.delivery.counters import Counters
from taas_magic.delivery.transport import channel_pair, put_file, take_waiting_file
from taas_magic.errors import first_line
from taas_magic.process import kernel_debugger
from taas_magic.wire import memfile
from taas_magic.wire.task import LoaderPlan

ASK_SECONDS = 60.0  # a host's agent that does not say where it streams from this soon is taken for gone
POLL_SECONDS = 0.005  # how often a node of ranks looks at its ranks' counters when no element arrives


@dataclass
class _Loader:
    """One loader's channels and counters on this node."""

    counters_fd: int
    counters: Counters
    inbox: dict[int, socket.socket] = field(default_factory=dict)  # host: every rank's end, read by streams
    outbox: dict[int, socket.socket] = field(default_factory=dict)  # rank node: producers' end of each local rank's
    handed: list[socket.socket] = field(default_factory=list)  # ends the fork server's processes get


@dataclass
class _Link:
    """A node of ranks' stream from one host of a loader."""

    address: str  # the host node's, for messages
    snapshots: relay.Snapshots
    open: set[int]  # this node's ranks the host may still send elements to


class NodeDelivery:
    """A node's agent's side of one run's delivery: the channels' far ends, the streams between nodes."""

    def __init__(self, share: NodeShare):
        self.share = share
        self.loaders: list[_Loader] = []
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []
        self.links: list[socket.socket] = []  # a node of ranks' streams, ended by ``close``
        self.lock = threading.Lock()
        self.failure: str | None = None
        self.listener: relay.Listener | None = None
        try:
            for number, plan in enumerate(share.loaders):
                self.loaders.append(self._loader(plan, bool(share.hosted[number])))
            if share.listen:
                self.listener = relay.Listener(share.listen, share.secret, self._serve)
        except BaseException:
            self.close()
            raise

    def _loader(self, plan: LoaderPlan, hosts: bool) -> _Loader:
        fd = memfile.new_file("taas-counters", Counters.size(plan.producers, self.share.world))
        loader = _Loader(fd, Counters(plan.producers, self.share.world, fd))
        for rank in range(self.share.world) if hosts else ():
            producers_end, rank_end = channel_pair()
            loader.inbox[rank] = rank_end
            loader.handed.append(producers_end)
        for rank in self.share.ranks:
            producers_end, rank_end = channel_pair()
            producers_end.setblocking(False)  # a full channel must not stop the others' feeding
            loader.outbox[rank] = producers_end
            loader.handed.append(rank_end)
        return loader

    def ends(self) -> tuple[NodeEnds, list[int]]:
        """What the fork server's request carries: the layout, and the descriptors in its order."""
        fds: list[int] = []

        def place(items: Collection[int]) -> tuple[int, ...]:
            fds.extend(items)
            return tuple(range(len(fds) - len(items), len(fds)))

        counters, producers_ends, rank_ends = [], [], []
        for loader in self.loaders:
            counters.append(place([loader.counters_fd])[0])
            hosts = len(loader.inbox)
            producers_ends.append(place([end.fileno() for end in loader.handed[:hosts]]))
            rank_ends.append(place([end.fileno() for end in loader.handed[hosts:]]))
        # the agents' handles and the run's secret stay with the agent
        share = dataclasses.replace(self.share, sources=(), secret=b"")
        return NodeEnds(share, tuple(counters), tuple(producers_ends), tuple(rank_ends)), fds

    def handed_over(self) -> None:
        """The fork server has its copies: this process's are closed, so that a channel's end is seen
        when the processes at the other end are gone."""
        for loader in self.loaders:
            for end in loader.handed:
                end.close()
            loader.handed = []
            os.close(loader.counters_fd)
            loader.counters_fd = -1

    # -- a host: streaming elements to a node of ranks ----------------------------------------------
    def relay_address(self) -> tuple[str, int]:
        """Where nodes of ranks connect for this node's producers' elements; ("", 0) when it hosts none."""
        return (self.listener.address, self.listener.port) if self.listener is not None else ("", 0)

    def _serve(self, sock: socket.socket, number: int, ranks: tuple[int, ...]) -> None:
        """Stream what this node's producers make for ``ranks`` (a node of ranks') as it comes, and take
        in that node's counters as they come back, until that node has read what it needs."""
        if number >= len(self.loaders):
            return  # a node of this run would not ask: nothing to serve
        loader = self.loaders[number]
        theirs = [rank for rank in ranks if rank not in self.share.ranks]  # this node's own write theirs here
        incoming = relay.Incoming(sock, Counters.size(loader.counters.producers, self.share.world))
        open_ranks = [rank for rank in ranks if rank in loader.inbox]
        while not self.stopped.is_set():
            readable = select.select([sock, *(loader.inbox[rank] for rank in open_ranks)], [], [], 0.1)[0]
            if sock in readable:
                snapshot, finished = incoming.read()
                if snapshot is not None:
                    loader.counters.take_rows(snapshot, ranks=theirs)
                if finished:
                    return
            for rank in list(open_ranks):
                if loader.inbox[rank] in readable and not _stream_waiting(sock, loader.inbox[rank], rank):
                    open_ranks.remove(rank)
                    relay.send_last(sock, rank)

    # -- a node of ranks: reading from the hosts ----------------------------------------------------
    def start_feeding(self, get: Callable[[Any, float], Any]) -> None:
        """A thread per loader reads this node's elements from its hosts (``get`` is ``ray.get``)."""
        if not self.share.ranks:
            return
        for number in range(len(self.loaders)):
            self.threads.append(kernel_debugger.hidden_thread(self._feed, number, get, name=f"taas-feed-{number}"))

    def _feed(self, number: int, get: Callable[[Any, float], Any]) -> None:
        """Connect to every host of loader ``number`` and put what comes into the ranks' channels."""
        loader = self.loaders[number]
        name = self.share.loaders[number].name
        links: dict[socket.socket, _Link] = {}
        waiting: dict[int, list[tuple[bytes, int]]] = {rank: [] for rank in self.share.ranks}
        address = "?"
        try:
            for agent, address in self.share.sources[number]:
                sock = self._connect(agent, number, get)
                if sock is not None:
                    links[sock] = _Link(address, relay.Snapshots(sock), set(self.share.ranks))
            self._relay(loader, links, waiting)
            while any(waiting.values()) and not self.stopped.wait(0.01):
                _put_waiting(loader.outbox, waiting)
        except _HostLost as e:
            if not self.stopped.is_set():  # the kernel sees the host gone too, and ends the run
                self.failure = f"node {e.address}, which hosts producers of {name}, {e.what}"
        except Exception as e:
            if not self.stopped.is_set():
                self.failure = f"node {address}, which hosts producers of {name}, did not answer: {first_line(e)}"
        finally:
            for sock in links:
                sock.close()
            for elements in waiting.values():
                for _, fd in elements:
                    os.close(fd)
            for end in loader.outbox.values():
                end.close()  # every producer is done: a rank waiting for more is told so (EOFError)

    def _connect(self, agent: Any, number: int, get: Callable[[Any, float], Any]) -> socket.socket | None:
        """A stream from a host (its agent says where once the run has started there); None if it
        has nothing for this node, or the run is over."""
        while not self.stopped.is_set():
            where = get(agent.relay_address.remote(self.share.run_id), ASK_SECONDS)
            if where is None:  # the run has not started there yet (the agent waited a little)
                continue
            if not where[1]:
                return None
            sock = relay.connect(where[0], where[1], self.share.secret, number, self.share.ranks)
            with self.lock:
                self.links.append(sock)
                if self.stopped.is_set():
                    sock.close()
                    return None
            return sock
        return None

    def _relay(
        self, loader: _Loader, links: dict[socket.socket, _Link], waiting: dict[int, list[tuple[bytes, int]]]
    ) -> None:
        """Elements from the hosts into the ranks' channels, and the ranks' counters back to the hosts
        (their producers stay within the window of the slowest rank), until every host has sent its
        last or every rank here is done."""
        reader = relay.Reader()
        try:
            self._relay_with(reader, loader, links, waiting)
        finally:
            reader.close()

    def _relay_with(
        self,
        reader: relay.Reader,
        loader: _Loader,
        links: dict[socket.socket, _Link],
        waiting: dict[int, list[tuple[bytes, int]]],
    ) -> None:
        told: list[int] = []
        while links and not self.stopped.is_set():
            if all(loader.counters.is_done(rank) for rank in self.share.ranks):
                self._say_done(loader, links)
                return
            snapshot = loader.counters.snapshot()
            for link in links.values():
                if snapshot != told:
                    link.snapshots.offer(relay.snapshot_bytes(snapshot))
                link.snapshots.flush()
            told = snapshot
            for sock in select.select(list(links), [], [], POLL_SECONDS)[0]:
                link = links[sock]
                rank, header, fd = _receive(link, sock, reader)
                if fd >= 0:
                    waiting[rank].append((header, fd))
                    continue
                link.open.discard(rank)
                if not link.open:  # that host is done with this node
                    del links[sock]
                    sock.close()
            _put_waiting(loader.outbox, waiting)

    def _say_done(self, loader: _Loader, links: dict[socket.socket, _Link]) -> None:
        """Every rank here is done: the hosts are told (their producers stop waiting for these ranks),
        and what they were still sending is read to its end and thrown away."""
        final = relay.snapshot_bytes(loader.counters.snapshot())
        for link in links.values():
            link.snapshots.offer(final)
        unsent = dict(links)
        reading = dict(links)
        while reading and not self.stopped.is_set():
            readable, writable, _ = select.select(list(reading), list(unsent), [], 0.1)
            for sock in writable:
                if unsent[sock].snapshots.flush():
                    sock.shutdown(socket.SHUT_WR)  # the host reads the snapshot, then the end, and closes
                    del unsent[sock]
            for sock in readable:
                if not _discard(sock):
                    reading.pop(sock)
                    unsent.pop(sock, None)

    def snapshots(self) -> list[list[int]]:
        return [loader.counters.snapshot() for loader in self.loaders]

    def take_counters(self, merged: list[list[int]]) -> None:
        """Copy in, from every node's counters ``merged``, the rows this node only reads: its copy has its own
        ranks' and producers' rows fresh, the others' only where they went up a stream to a host. A new process in
        place of a rank that died takes over its share from them (``StandIn.take_over``)."""
        share = self.share
        for number, (loader, snapshot) in enumerate(zip(self.loaders, merged)):
            producers = [p for p in range(loader.counters.producers) if p not in share.hosted[number]]
            ranks = [rank for rank in range(share.world) if rank not in share.ranks]
            loader.counters.take_rows(snapshot, producers=producers, ranks=ranks)

    def close(self) -> None:
        self.stopped.set()
        if self.listener is not None:
            self.listener.close()
        with self.lock:
            for sock in self.links:
                _shut(sock)  # a thread reading from a host wakes
        for thread in self.threads:
            thread.join(1.0)
        for loader in self.loaders:
            for end in [*loader.inbox.values(), *loader.outbox.values(), *loader.handed]:
                end.close()
            if loader.counters_fd >= 0:
                os.close(loader.counters_fd)
                loader.counters_fd = -1


class _HostLost(Exception):
    def __init__(self, address: str, what: str):
        super().__init__(what)
        self.address, self.what = address, what


def _receive(link: _Link, sock: socket.socket, reader: relay.Reader) -> tuple[int, bytes, int]:
    try:
        rank, header, fd = reader.receive(sock)
    except (OSError, ConnectionError) as e:
        raise _HostLost(link.address, f"closed its stream: {first_line(e)}") from e
    if rank not in link.open:
        if fd >= 0:
            os.close(fd)
        raise _HostLost(link.address, f"sent an element for rank {rank}, which is not this node's")
    return rank, header, fd


def _discard(sock: socket.socket) -> bool:
    """Read and drop what waits; whether the other end is still open."""
    try:
        return bool(sock.recv(relay.CHUNK, socket.MSG_DONTWAIT))
    except BlockingIOError:
        return True
    except OSError:
        return False


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _stream_waiting(sock: socket.socket, channel: socket.socket, rank: int) -> bool:
    """Send what waits on a rank's channel (a few at a time); False once every producer has closed it."""
    for _ in range(relay.ELEMENTS_AT_ONCE):
        taken = take_waiting_file(channel)
        if taken is None:
            return True
        header, fd = taken
        if fd < 0:
            return False
        try:
            relay.send_element(sock, rank, header, fd)
        finally:
            os.close(fd)
    return True


def _put_waiting(outbox: dict[int, socket.socket], waiting: dict[int, list[tuple[bytes, int]]]) -> None:
    """Into each rank's channel, what it can take now, in order; a rank that has left takes nothing."""
    for rank, elements in waiting.items():
        while elements:
            header, fd = elements[0]
            try:
                put_file(outbox[rank], header, fd)
            except BlockingIOError:
                break
            except OSError:  # the rank is gone
                for _, unsent in elements:
                    os.close(unsent)
                elements.clear()
                break
            os.close(fd)
            elements.pop(0)
